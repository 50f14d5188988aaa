"""Reading safetensors checkpoints: find the shards, validate every file's header and size before
anything is loaded, and read tensors one at a time straight into their place on the target device."""

from __future__ import annotations

import bisect
import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparkchat.engine.errors import ModelError

_MAX_HEADER = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB
_STAGING_BYTES = 64 * 1024 * 1024  # the pinned buffer a CUDA tensor's bytes pass through
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16,
                "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
                "F64": torch.float64}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]
    offset: int = 0  # of its first byte in the file
    nbytes: int = 0


def parse_header(path: str | Path) -> dict[str, Any]:
    """Parse and check a safetensors header: {name: {dtype, shape, data_offsets}} (plus __metadata__).

    Raises ValueError saying what is wrong: truncated file, bad length, bad JSON, offsets past the end."""
    return header_and_data_start(path)[0]


def header_and_data_start(path: str | Path) -> tuple[dict[str, Any], int]:
    """parse_header's answer, and the file offset its data_offsets count from."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"file is {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} does not fit in the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    data = size - 8 - n
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = t["dtype"], t["shape"], t["data_offsets"]
            ok = isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"tensor {name!r} has a malformed entry")
        if dtype in DTYPE_BYTES:
            count = 1
            for d in shape:
                count *= d
            if count * DTYPE_BYTES[dtype] != hi - lo:
                raise ValueError(f"tensor {name!r}: {hi - lo} bytes for shape {shape} {dtype}")
        end = max(end, hi)
    if end > data:
        raise ValueError(f"data section is {data} bytes but tensors reach byte {end} (truncated)")
    return header, 8 + n


def read_header(path: Path) -> dict[str, Any]:
    """parse_header, failing with a one-line ModelError that names the file."""
    return _read_header_and_data_start(path)[0]


def _read_header_and_data_start(path: Path) -> tuple[dict[str, Any], int]:
    try:
        return header_and_data_start(path)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ModelError(f"{path.name} is corrupt or truncated: {e}") from None


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelError(f"{index.name} in {model_dir} is not a valid safetensors index") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no .safetensors weights in {model_dir} (sparkchat loads safetensors only)")
    return files


class CheckpointReader:
    """Name → tensor over all shards, each tensor read straight into its place on `device`.

    Reads with plain reads at known offsets, not mmap: on the DGX Spark mmap'd loading is reported
    several times slower, and the page cache a load fills is host memory in the same 128 GB the
    weights go to (where CUDA allocations do not reclaim it: out-of-memory with the cache full).
    With `drop_page_cache` (unified-memory machines) every shard's cached pages are dropped when the
    reader opens and each tensor's pages right after it is read, so the weights are never held twice.
    A CUDA tensor goes through one reused pinned buffer of at most `_STAGING_BYTES`."""

    def __init__(self, model_dir: str | Path, device: torch.device | str,
                 drop_page_cache: bool = False) -> None:
        self.dir = Path(model_dir)
        self.device = torch.device(device)
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self.tensors: dict[str, TensorInfo] = {}
        # byte spans read so far per file, merged: (starts, ends), both sorted
        self._done: dict[Path, tuple[list[int], list[int]]] = {}
        for path in checkpoint_files(self.dir):
            header, start = _read_header_and_data_start(path)
            self._done[path] = ([0], [start])
            for name, info in header.items():
                if name != "__metadata__":
                    lo, hi = info["data_offsets"]
                    self.tensors[name] = TensorInfo(path, info["dtype"], tuple(info["shape"]), start + lo, hi - lo)
        self._files: dict[Path, Any] = {}
        self._staging: torch.Tensor | None = None
        self.bytes_total = sum(t.nbytes for t in self.tensors.values())
        self.bytes_read = 0
        if self.drop_page_cache:  # e.g. a download's pages, before any weight is allocated
            for path in {t.file for t in self.tensors.values()}:
                self._drop(self._open(path), 0, 0)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise ModelError(f"tensor {name} is missing from the checkpoint in {self.dir}")
        return self.tensors[name]

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        info = self.info(name)
        if shape is not None and info.shape != tuple(shape):
            raise ModelError(f"tensor {name} in {info.file.name} has shape {list(info.shape)}, "
                             f"the config needs {list(shape)}")
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise ModelError(f"tensor {name} in {info.file.name} has dtype {info.dtype}, which sparkchat "
                             "does not load")
        out = torch.empty(info.shape, dtype=dtype, device=self.device)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Fill `dst` (contiguous, any dtype, the tensor's byte size) with the tensor's stored bytes."""
        info = self.info(name)
        if not dst.is_contiguous() or dst.numel() * dst.element_size() != info.nbytes:
            raise ValueError(f"{name}: destination of {dst.numel() * dst.element_size()} bytes "
                             f"for {info.nbytes} stored")
        if info.nbytes == 0:
            return
        raw = self._open(info.file)
        dst_bytes = dst.reshape(-1).view(torch.uint8)
        if dst.device.type == "cpu":
            self._read(raw, info, info.offset, dst_bytes)
        else:
            self._read_staged(raw, info, dst_bytes)
        self.bytes_read += info.nbytes
        if self.drop_page_cache:
            lo, hi = self._mark_done(info.file, info.offset, info.offset + info.nbytes)
            self._drop(raw, lo, hi - lo)

    def _read_staged(self, raw: Any, info: TensorInfo, dst_bytes: torch.Tensor) -> None:
        staging = self._staging_buffer()
        for at in range(0, info.nbytes, staging.numel()):
            n = min(staging.numel(), info.nbytes - at)
            self._read(raw, info, info.offset + at, staging[:n])
            dst_bytes[at:at + n].copy_(staging[:n])  # synchronous: the buffer is free when it returns

    def _mark_done(self, path: Path, lo: int, hi: int) -> tuple[int, int]:
        """Add [lo, hi) to the file's read spans; return the merged span holding it.

        The page cache keeps folios of up to 2 MB (more as read-ahead grows), and advice drops only
        whole ones: a folio across two tensors goes once both are read, so advise the merged span."""
        starts, ends = self._done[path]
        i = bisect.bisect_left(ends, lo)  # the first span ending at or after lo
        j = bisect.bisect_right(starts, hi)  # past the last span starting at or before hi
        if i < j:
            lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
        starts[i:j], ends[i:j] = [lo], [hi]
        return lo, hi

    def close(self) -> None:
        for raw in self._files.values():
            if self.drop_page_cache:  # what read-ahead still had in flight when its span was advised
                self._drop(raw, 0, 0)
            raw.close()
        self._files.clear()
        self._staging = None

    def _open(self, path: Path) -> Any:
        raw = self._files.get(path)
        if raw is None:
            try:
                raw = open(path, "rb", buffering=0)
            except OSError as e:
                raise ModelError(f"cannot open {path.name}: {e.strerror}") from None
            self._files[path] = raw
        return raw

    @staticmethod
    def _read(raw: Any, info: TensorInfo, offset: int, dst: torch.Tensor) -> None:
        """Read len(dst) bytes at `offset` into a CPU uint8 tensor, with no intermediate copy."""
        view = memoryview((ctypes.c_ubyte * dst.numel()).from_address(dst.data_ptr())).cast("B")
        done = 0
        try:
            raw.seek(offset)
            while done < len(view):
                n = raw.readinto(view[done:])
                if not n:
                    raise ModelError(f"{info.file.name} ends early: it is truncated or changed while loading")
                done += n
        except OSError as e:
            raise ModelError(f"cannot read {info.file.name}: {e.strerror}") from None

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            largest = max((t.nbytes for t in self.tensors.values()), default=1)
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            self._staging = torch.empty(min(largest, _STAGING_BYTES), dtype=torch.uint8, pin_memory=pin)
        return self._staging

    @staticmethod
    def _drop(raw: Any, offset: int, length: int) -> None:
        try:
            os.posix_fadvise(raw.fileno(), offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # a file system that keeps no page cache, or refuses advice: nothing to drop
            pass

