"""How fast a checkpoint's tensors reach the device, and how much of it the page cache keeps afterwards.

Three ways, each from a cold cache (the files' pages dropped with posix_fadvise first, no root needed):
safetensors' mmap'd `safe_open` (what the loader used before), sparkchat's positioned reads keeping the
page cache, and the same dropping each tensor's pages as it goes (the loader's way on unified memory).
Writes synthetic shards (`--gb`, `--shard-gb`) unless `--model DIR` names a checkpoint.

    python benchmarks/checkpoint_read.py --gb 2 --device cpu
    python benchmarks/checkpoint_read.py --model ~/models/Ling-3.0-flash-fp4 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _drop(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached_bytes(files: list[Path]) -> int:
    from tests.test_checkpoint_reader import _resident_pages
    import mmap

    return sum(_resident_pages(f) for f in files) * mmap.PAGESIZE


def _write_shards(directory: Path, gb: float, shard_gb: float) -> None:
    import torch
    from safetensors.torch import save_file

    per = 1 << 20  # 1 MiB tensors, about an expert's gate or up rows in the fp4 release
    total, shard, i = int(gb * 2**30), 0, 0
    while total > 0:
        n = min(total, int(shard_gb * 2**30)) // per
        save_file({f"t{i + k:07}": torch.randint(0, 256, (per,), dtype=torch.uint8) for k in range(n)},
                  directory / f"model-{shard:05}.safetensors")
        i, shard, total = i + n, shard + 1, total - n * per
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: synthetic shards)")
    ap.add_argument("--gb", type=float, default=2.0, help="synthetic checkpoint size")
    ap.add_argument("--shard-gb", type=float, default=0.5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="each way this often, medians reported")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from safetensors import safe_open

    from sparkchat.engine.checkpoint import CheckpointReader, checkpoint_files

    tmp = None
    directory = args.model
    if directory is None:
        tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp"))
        directory = Path(tmp.name)
        _write_shards(directory, args.gb, args.shard_gb)
    files = checkpoint_files(directory)
    size = sum(f.stat().st_size for f in files)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def safetensors_mmap() -> None:
        for f in files:
            with safe_open(str(f), framework="pt", device=args.device) as h:
                for name in h.keys():
                    h.get_tensor(name).sum()  # touch it: on the CPU the tensor may still be the mapping

    def reader(drop: bool) -> None:
        r = CheckpointReader(directory, args.device, drop_page_cache=drop)
        for name in r.tensors:
            r.get(name).sum()
        r.close()

    ways = [("safetensors safe_open (mmap)", safetensors_mmap),
            ("sparkchat reader, cache kept", lambda: reader(False)),
            ("sparkchat reader, cache dropped", lambda: reader(True))]
    seconds: dict[str, list[float]] = {label: [] for label, _ in ways}
    cached: dict[str, int] = {}
    for r in range(args.rounds):  # each round in another order: a disk (or its host) has caches too
        for label, run in ways[r % len(ways):] + ways[:r % len(ways)]:
            _drop(files)
            t0 = time.perf_counter()
            run()
            sync()
            seconds[label].append(time.perf_counter() - t0)
            cached[label] = _cached_bytes(files)
    rows = []
    for label, _ in ways:
        best = sorted(seconds[label])[len(seconds[label]) // 2]
        rows.append({"way": label, "seconds": [round(t, 3) for t in seconds[label]],
                     "GB_per_s": round(size / best / 1e9, 2), "page_cache_after_GB": round(cached[label] / 1e9, 3)})
    _drop(files)
    result = {"bytes": size, "files": len(files), "device": args.device, "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{size / 1e9:.2f} GB in {len(files)} files to {args.device}, each run from a cold page cache")
        for r in rows:
            times = " ".join(f"{t:.2f}" for t in r["seconds"])
            print(f"  {r['way']:<34} {r['GB_per_s']:>6.2f} GB/s (median; s: {times})   "
                  f"page cache after: {r['page_cache_after_GB']:.3f} GB")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
