"""How long a process waits on its first prompt of each length for fla-core's chunked KDA (H200 probe).

fla-core's kernels compile and autotune on first use; Triton keeps both on disk. Run it twice: the first
process shows the once-a-machine cost, the second what every later process pays (Engine.load's warm-up
pays it, kernels/kda_prefill.warm_up). One KDA layer at Ling-3.0-flash's shape (32 heads × 128).

    python benchmarks/prefill_first_call.py A; python benchmarks/prefill_first_call.py B --lengths 64 1000 12000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("SPARKCHAT_FLA_PREFILL", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", nargs="?", default="this process")
    ap.add_argument("--lengths", type=int, nargs="+", default=[37, 2048, 8192, 5000],
                    help="prompt lengths, in order, each timed on its first call")
    args = ap.parse_args()
    import torch

    from sparkchat.engine.nn.kda import kda_core
    from tests.test_kda_kernel import make_inputs

    seconds = {}
    for T in args.lengths:
        x, (conv, rec), w = make_inputs(T, 32, 128, 4, torch.bfloat16, "cuda")
        t0 = time.perf_counter()
        kda_core(*x, conv, rec, *w, 32, 128, True, -5.0, 1e-6, False, True)
        torch.cuda.synchronize()
        seconds[T] = round(time.perf_counter() - t0, 2)
    print(args.label, "first call s per T:", json.dumps(seconds), flush=True)


if __name__ == "__main__":
    main()
