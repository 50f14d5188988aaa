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

_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16", "F8_E4M3", "U8"
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, Any]:
    """Parse a safetensors header and check the file holds every byte the header promises."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelError(f"{path.name}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelError(f"{path.name}: corrupt or truncated safetensors header")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelError(f"{path.name}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path.name}: corrupt safetensors header")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            raise ModelError(f"{path.name}: corrupt safetensors entry for tensor {name}") from None
    if 8 + n + end > size:
        raise ModelError(f"{path.name} is truncated: {size} bytes, the header needs {8 + n + end}")
    return header


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
