"""MTP accept length with the truncated draft head, against the full head, through the engine.

The procedure of `tools/train_demo.py eval` (docs/demo-model.md): the first 20 held-out prompts of
test.jsonl, greedy, at most 160 tokens, thinking off and on, accept length pooled over the answers
(tokens after the first ÷ verify steps). For each draft vocabulary N it also reports the coverage: the
share of the target's tokens (what greedy decoding emitted) that are among the draft head's N rows.

    python tools/demo_data.py /tmp/demo_data          # test.jsonl (and train.npz for --corpus-ranking)
    python benchmarks/draft_head_accept.py --data /tmp/demo_data --vocab 512 1024 2048 4096 \
        --corpus-ranking --json benchmarks/results-2026-12-02-draft-head-demo.json

`--corpus-ranking` also ranks the tokens by their count in the demo's training answers (decoded with
the data's tokenizer, re-encoded with the model's) and measures N with that ranking: what a ranked-id
file (`draft_vocab.json`) buys over the default BPE merge order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def accept(engine, prompts, *, n_prompts: int, max_tokens: int, rows: set[int] | None) -> dict:
    from sparkchat.engine.events import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = {}
    for thinking in (False, True):
        accepted = steps = 0.0
        covered = emitted = 0
        tokens: list[list[int]] = []
        for p in prompts[:n_prompts]:
            engine.reset()
            ids = engine.tokenizer.encode_chat(p["messages"], enable_thinking=thinking)
            stats, answer = None, []
            for ev in engine.generate_ids(ids, params):
                stats = ev.stats
                answer += ev.token_ids
            tokens.append(answer)
            if stats.accept_length_mean:
                accepted += stats.generated_tokens - 1
                steps += (stats.generated_tokens - 1) / stats.accept_length_mean
            emitted += len(answer)
            covered += len(answer) if rows is None else sum(t in rows for t in answer)
        out["thinking" if thinking else "no_thinking"] = {
            "accept_length": accepted / steps if steps else None, "coverage": covered / max(emitted, 1),
            "tokens": emitted, "token_ids": tokens}
    return out


def corpus_ranking(data: Path, model_dir: Path) -> list[int]:
    """Token ids of the model's tokenizer by their count in the training answers."""
    import numpy as np
    from tokenizers import Tokenizer

    from sparkchat.engine.draft_vocab import rank_corpus
    from sparkchat.engine.tokenizer import ChatTokenizer

    train = np.load(data / "train.npz")
    data_tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    texts = (data_tok.decode(train["tokens"][s + p:s + n].tolist(), skip_special_tokens=False)
             for s, p, n in train["index"].tolist())
    ranked, _ = rank_corpus(ChatTokenizer.from_dir(model_dir), texts)
    return ranked


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "assets" / "demo")
    ap.add_argument("--data", type=Path, required=True, help="tools/demo_data.py's output (test.jsonl)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--draft-steps", type=int, default=3)
    ap.add_argument("--fp8-head", action="store_true", help="FP8 head (the CPU default is the BF16 one)")
    ap.add_argument("--corpus-ranking", action="store_true")
    ap.add_argument("--json", type=Path, help="write every figure (and the emitted token ids) here")
    args = ap.parse_args()
    import torch

    from sparkchat.engine.draft_vocab import RANKING_ENV
    from sparkchat.engine.events import Switches
    from sparkchat.engine.session import Engine

    torch.set_num_threads(os.cpu_count() or 1)
    prompts = [json.loads(line) for line in (args.data / "test.jsonl").read_text().splitlines()]
    rankings = [("merge order", None)]
    if args.corpus_ranking:
        ranked = corpus_ranking(args.data, args.model)
        f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(ranked, f)
        f.close()
        rankings.append(("training-answer counts", f.name))
    results = []
    for label, ranking_file in rankings:
        if ranking_file:
            os.environ[RANKING_ENV] = ranking_file
        else:
            os.environ.pop(RANKING_ENV, None)
        engine = Engine.load(args.model, device="cpu")
        V = engine.config.vocab_size
        for n in ([V] if ranking_file is None else []) + args.vocab:
            t = time.perf_counter()
            engine.set_switches(Switches(mtp=True, draft_steps=args.draft_steps, fp8_head=args.fp8_head,
                                         mxfp4_kernels=False, cuda_graphs=False,
                                         truncated_draft_head=n < V, draft_vocab=max(n, 64)))
            rows = engine.draft_rows(n) if n < V else None
            r = accept(engine, prompts, n_prompts=args.prompts, max_tokens=args.max_tokens,
                       rows=None if rows is None else set(rows))
            r.update(ranking=label if n < V else "full head", draft_vocab=n, vocab=V, seconds=time.perf_counter() - t,
                     ranking_source=engine.draft_ranking_source if n < V else None)
            same = all(r[m]["token_ids"] == results[0][m]["token_ids"] for m in ("thinking", "no_thinking")) \
                if results else True
            r["output_identical_to_full_head"] = same  # greedy: the verify decides every token
            results.append(r)
            print(f"{r['ranking']:>22}  N={n:5d}  accept no-think {r['no_thinking']['accept_length']:.3f} "
                  f"(coverage {r['no_thinking']['coverage']:.3f})  think {r['thinking']['accept_length']:.3f} "
                  f"(coverage {r['thinking']['coverage']:.3f})  {r['seconds']:.0f} s"
                  f"{'' if same else '  OUTPUT DIFFERS FROM THE FULL HEAD'}", flush=True)
    if args.json:
        for r in results[1:]:  # the full head's answers are every configuration's (greedy): keep one copy
            for mode in ("thinking", "no_thinking"):
                r[mode].pop("token_ids")
        model = args.model.resolve()
        meta = {"model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
                "prompts": args.prompts, "max_tokens": args.max_tokens,
                "draft_steps": args.draft_steps, "fp8_head": args.fp8_head, "torch": torch.__version__}
        args.json.write_text(json.dumps({"meta": meta, "results": results}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
