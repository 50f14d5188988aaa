"""Failures at the command's edges: stdout write errors told apart from other OSErrors (a closed pipe
ends quietly like Unix tools, a full disk gets one line), and memory that cannot be allocated."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class OutputError(Exception):
    """Writing the command's output to stdout failed; `error` is the OSError underneath."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _MarkedStream:
    """stdout with its write errors raised as OutputError: an OSError from a socket or a file a command
    reads must not be reported as 'cannot write the output'."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputError(e) from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputError(e) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def marked_stdout() -> Iterator[None]:
    real = sys.stdout
    sys.stdout = _MarkedStream(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = real


def silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null: the bytes of a failed write still wait in its buffer,
    and the interpreter's flush at exit would fail again, with a traceback-like message."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a real file (tests capture it)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


_OOM = re.compile(r"out of memory|not enough memory|can't allocate memory", re.IGNORECASE)


def out_of_memory_message(error: BaseException) -> str | None:
    """One line for torch's allocation failures (CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError); None for any other error."""
    if type(error).__name__ != "OutOfMemoryError" and not _OOM.search(str(error)):
        return None
    size = re.search(r"tried to allocate (\d+ bytes|[\d.]+ ?[KMGT]?i?B\b)", str(error), re.IGNORECASE)
    tried = f" (tried to allocate {size.group(1)})" if size else ""
    return f"out of memory{tried}: try a shorter context"
