"""The checkpoint reader: bytes as safetensors stores them, read without mmap, page cache dropped on request."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sparkchat.engine import checkpoint
from sparkchat.engine.checkpoint import CheckpointReader
from sparkchat.engine.errors import ModelError


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ints = torch.randint(-100, 100, (3, 5), generator=g)
    return {
        "bf16": torch.randn(7, 33, generator=g).bfloat16(),
        "f16": torch.randn(4, 4, generator=g).half(),
        "f32": torch.randn(129, generator=g),
        "f64": torch.randn(2, 3, generator=g).double(),
        "e4m3": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(5, 8, generator=g).to(torch.float8_e5m2),
        "e8m0": torch.randint(0, 255, (6, 2), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu),
        "u8": torch.randint(0, 256, (31, 3), dtype=torch.uint8, generator=g),
        "i8": ints.to(torch.int8),
        "i16": ints.to(torch.int16),
        "i32": ints.to(torch.int32),
        "i64": ints,
        "bool": ints > 0,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def test_every_dtype_reads_back_as_safetensors_loads_it(tmp_path):
    tensors = _every_dtype()
    half = len(tensors) // 2
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:half]}, tmp_path / "a.safetensors", metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[half:]}, tmp_path / "b.safetensors")
    expected = {**load_file(tmp_path / "a.safetensors"), **load_file(tmp_path / "b.safetensors")}
    reader = CheckpointReader(tmp_path, "cpu")
    for name, want in expected.items():
        got = reader.get(name, tuple(want.shape))
        assert _same_bytes(got, want), name
    assert reader.bytes_read == reader.bytes_total == sum(t.numel() * t.element_size() for t in tensors.values())
    reader.close()


def test_a_tensor_larger_than_the_staging_buffer_arrives_whole(tmp_path, monkeypatch):
    # the path a CUDA tensor takes (through a reused buffer), run here into a CPU destination
    monkeypatch.setattr(checkpoint, "_STAGING_BYTES", 1000)
    w = torch.randn(37, 101).bfloat16()  # 7474 bytes: seven full buffers and a part
    save_file({"w": w, "small": torch.arange(3)}, tmp_path / "m.safetensors")
    reader = CheckpointReader(tmp_path, "cpu")
    out = torch.empty_like(w)
    raw = reader._open(reader.info("w").file)
    reader._read_staged(raw, reader.info("w"), out.reshape(-1).view(torch.uint8))
    assert reader._staging_buffer().numel() == 1000
    assert torch.equal(out, w)


def test_reading_into_a_slice_of_a_larger_tensor(tmp_path):
    rows = torch.randint(0, 256, (4, 16), dtype=torch.uint8)
    save_file({"rows": rows}, tmp_path / "m.safetensors")
    reader = CheckpointReader(tmp_path, "cpu")
    dst = torch.zeros(3, 8, 16, dtype=torch.uint8)
    reader.read_into("rows", dst[1, 2:6])
    assert torch.equal(dst[1, 2:6], rows) and dst.sum() == rows.sum()
    with pytest.raises(ValueError, match="destination of 48 bytes"):
        reader.read_into("rows", dst[1, :3])


def test_a_file_cut_short_after_its_header_was_checked_is_a_model_error(tmp_path):
    save_file({"w": torch.randn(64, 64)}, tmp_path / "m.safetensors")
    reader = CheckpointReader(tmp_path, "cpu")
    path = tmp_path / "m.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(ModelError, match="m.safetensors ends early"):
        reader.get("w")


def test_a_dtype_the_engine_does_not_load_is_a_model_error(tmp_path):
    header = json.dumps({"c": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ModelError, match="has dtype C64"):
        CheckpointReader(tmp_path, "cpu").get("c")


def test_dropping_the_page_cache_advises_every_file_then_every_tensor(tmp_path, monkeypatch):
    save_file({"x": torch.randn(10), "y": torch.randn(3, 3)}, tmp_path / "a.safetensors")
    save_file({"z": torch.randn(5)}, tmp_path / "b.safetensors")
    calls: list[tuple[str, int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, off, n, advice: calls.append((os.readlink(f"/proc/self/fd/{fd}"), off, n, advice)))
    reader = CheckpointReader(tmp_path, "cpu", drop_page_cache=True)
    files = sorted({c[0] for c in calls})
    assert [Path(f).name for f in files] == ["a.safetensors", "b.safetensors"]
    assert all(c[1:] == (0, 0, os.POSIX_FADV_DONTNEED) for c in calls)
    calls.clear()
    y, z, x = (reader.info(n) for n in "yzx")
    data_a = x.offset  # x is a's first tensor (safetensors sorts them), its header ends there
    reader.get("y")  # not touching the header: advised alone
    assert calls[-1] == (str(y.file.resolve()), y.offset, y.nbytes, os.POSIX_FADV_DONTNEED)
    reader.get("z")  # b's only tensor: its span joins b's header, so the whole file is advised
    assert calls[-1] == (str(z.file.resolve()), 0, z.offset + z.nbytes, os.POSIX_FADV_DONTNEED)
    reader.get("x")  # the gap between a's header and y closes: everything read so far
    assert calls[-1] == (str(x.file.resolve()), 0, y.offset + y.nbytes, os.POSIX_FADV_DONTNEED)
    assert data_a + x.nbytes == y.offset and len(calls) == 3
    calls.clear()
    CheckpointReader(tmp_path, "cpu").get("x")  # not asked to: no advice
    assert calls == []


def _resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache now (mincore over a shared read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)


def _cache_can_be_dropped(path: Path) -> bool:
    with open(path, "rb") as f:
        f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return _resident_pages(path) == 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not Path("/proc/self/fd").exists(), reason="Linux only")
def test_a_load_that_drops_the_page_cache_leaves_none_of_the_weights_cached(tmp_path):
    # 64 MB: more than a few times what the kernel may read ahead (read_ahead_kb is 128 to 8192)
    tensors = {f"w{i:02}": torch.randn(256, 1024) for i in range(64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # dirty pages cannot be dropped
    if not _cache_can_be_dropped(path):
        pytest.skip(f"the file system under {tmp_path} keeps no page cache that advice can drop")
    pages = -(-path.stat().st_size // mmap.PAGESIZE)
    path.read_bytes()  # as a download leaves it
    # (nearly) all cached: a busy machine's kernel may reclaim a few pages at any time
    assert _resident_pages(path) > pages * 0.9

    reader = CheckpointReader(tmp_path, "cpu", drop_page_cache=True)
    assert _resident_pages(path) == 0  # dropped before any weight is read
    most = 0
    for name, want in tensors.items():
        assert torch.equal(reader.get(name), want)
        most = max(most, _resident_pages(path))  # the kernel's read-ahead of the next tensors, no more
    assert most < pages // 2, f"{most} of {pages} pages cached at once"
    assert _resident_pages(path) == 0
    reader.close()

    reader = CheckpointReader(tmp_path, "cpu")  # the default keeps what it reads cached
    for name in tensors:
        reader.get(name)
    assert _resident_pages(path) > pages * 0.9


def test_read_spans_merge_in_any_order(tmp_path):
    save_file({"w": torch.zeros(1)}, tmp_path / "m.safetensors")
    reader = CheckpointReader(tmp_path, "cpu")
    path = reader.info("w").file
    reader._done[path] = ([0], [10])
    mark = reader._mark_done
    assert mark(path, 30, 40) == (30, 40)
    assert mark(path, 50, 60) == (50, 60)
    assert mark(path, 12, 20) == (12, 20)
    assert reader._done[path] == ([0, 12, 30, 50], [10, 20, 40, 60])
    assert mark(path, 20, 30) == (12, 40)  # touching spans join
    assert mark(path, 5, 55) == (0, 60)
    assert reader._done[path] == ([0], [60])
    assert mark(path, 70, 80) == (70, 80) and mark(path, 60, 70) == (0, 80)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_dtype_reaches_the_gpu_through_the_staging_buffer_intact(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_STAGING_BYTES", 96)  # several passes for most tensors
    tensors = _every_dtype()
    save_file(tensors, tmp_path / "m.safetensors")
    reader = CheckpointReader(tmp_path, "cuda", drop_page_cache=True)
    for name, want in tensors.items():
        got = reader.get(name)
        assert got.is_cuda and _same_bytes(got.cpu(), want), name
    assert reader._staging_buffer().is_pinned()
    dst = torch.zeros(3, *tensors["u8"].shape, dtype=torch.uint8, device="cuda")
    reader.read_into("u8", dst[1])
    assert torch.equal(dst[1].cpu(), tensors["u8"]) and int(dst[0].sum()) == int(dst[2].sum()) == 0


DEMO = Path(__file__).resolve().parents[1] / "assets" / "demo"


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the modules hold, registered or set as plain attributes (packed weights are)."""
    out = {}
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                out[f"{path}.{attr}"] = value
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            out[f"{path}.{name}"] = t
    return out


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not built")
def test_the_fp4_release_loads_the_same_with_the_page_cache_dropped(tmp_path, monkeypatch):
    # the demo model is in the release format: FP8 block-scaled linears, MXFP4 experts read into place
    import shutil

    from sparkchat.engine import capabilities
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.loader import load_model

    for f in DEMO.iterdir():
        shutil.copy(f, tmp_path / f.name)
    kept = _weights(load_model(tmp_path, ModelConfig.from_dir(tmp_path), "cpu", max_context=64))
    monkeypatch.setattr(capabilities, "is_unified_memory", lambda device: True)
    dropped = _weights(load_model(tmp_path, ModelConfig.from_dir(tmp_path), "cpu", max_context=64))
    assert kept.keys() == dropped.keys() and any(".w13" in n for n in kept) and len(kept) > 200
    for name, t in kept.items():
        assert _same_bytes(t, dropped[name]), name
    shards = sorted(tmp_path.glob("*.safetensors"))
    if hasattr(os, "posix_fadvise") and all(_cache_can_be_dropped(f) for f in shards):
        load_model(tmp_path, ModelConfig.from_dir(tmp_path), "cpu", max_context=64)
        assert [_resident_pages(f) for f in shards] == [0] * len(shards)


def test_an_expert_tensor_of_the_wrong_width_is_a_model_error(tmp_path):
    from types import SimpleNamespace

    from sparkchat.engine.loader import _Loader

    save_file({"e.weight": torch.zeros(4, 8, dtype=torch.float16), "e.ok": torch.ones(4, 8, dtype=torch.uint8)},
              tmp_path / "m.safetensors")
    ld = _Loader(CheckpointReader(tmp_path, "cpu"), SimpleNamespace(quantization=None), torch.device("cpu"),
                 torch.float32, quantize_experts=False)
    dst = torch.zeros(2, 4, 8, dtype=torch.uint8)
    with pytest.raises(ModelError, match=r"e.weight in m.safetensors is F16 \[4, 8\], the config needs one byte"):
        ld._read_expert("e.weight", (4, 8), dst[1])
    with pytest.raises(ModelError, match=r"is U8 \[4, 8\], the config needs one byte per entry in \[4, 16\]"):
        ld._read_expert("e.ok", (4, 16), dst[1])
    ld._read_expert("e.ok", (4, 8), dst[1])
    assert dst[1].eq(1).all() and dst[0].eq(0).all()
