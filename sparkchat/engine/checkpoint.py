"""Reading safetensors checkpoints: find the shards, validate every file's header and size before
anything is loaded, and hand out tensors one at a time straight onto the target device."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparkchat.engine.errors import ModelError

_MAX_HEADER = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]


def parse_header(path: str | Path) -> dict[str, Any]:
    """Parse and check a safetensors header: {name: {dtype, shape, data_offsets}} (plus __metadata__).

    Raises ValueError saying what is wrong: truncated file, bad length, bad JSON, offsets past the end."""
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
    return header


def read_header(path: Path) -> dict[str, Any]:
    """parse_header, failing with a one-line ModelError that names the file."""
    try:
        return parse_header(path)
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
    """Name → tensor over all shards, opened lazily, each tensor placed directly on `device`."""

    def __init__(self, model_dir: str | Path, device: torch.device | str) -> None:
        self.dir = Path(model_dir)
        self.device = str(device)
        self.tensors: dict[str, TensorInfo] = {}
        for path in checkpoint_files(self.dir):
            for name, info in read_header(path).items():
                if name != "__metadata__":
                    self.tensors[name] = TensorInfo(path, info["dtype"], tuple(info["shape"]))
        self._handles: dict[Path, Any] = {}

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
        from safetensors import safe_open

        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt", device=self.device)
            except Exception as e:  # safetensors raises its own error types
                raise ModelError(f"cannot open {info.file.name}: {e}") from None
            self._handles[info.file] = handle
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ModelError(f"cannot read tensor {name} from {info.file.name}: {e}") from None

    def close(self) -> None:
        self._handles.clear()
