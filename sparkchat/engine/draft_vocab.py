"""The truncated draft head's vocabulary: which N tokens the MTP draft may propose.

The draft's head reads only the rows of the N most frequent tokens (`LMHead.set_draft_rows`); the
verify keeps the full head, so output is the target's either way and a draft that cannot name the
target's token only costs acceptance. What "most frequent" means, in order of preference:

1. a ranked-id file, most frequent first: `$SPARKCHAT_DRAFT_RANKING`, else `draft_vocab.json` in the
   model directory (a JSON list of token ids, or `{"ranked_ids": [...]}`, or whitespace-separated ids
   in a text file). Build one from text the model should speak with
   `python -m sparkchat.engine.draft_vocab --model DIR --out DIR/draft_vocab.json FILE...`
   (token counts over the files, as FR-Spec ranks from a corpus sample);
2. the tokenizer's BPE merge order (tokenizer.json): the base alphabet first, then each token at the
   index of the merge that made it. BPE merges the most frequent pair first and the winning pair's
   count never rises from one merge to the next, while a token's count in the final tokenization
   never exceeds its count when it was made; so every token that occurs more often than the N-th
   merge's pair count (in the tokenizer's training corpus) is among the first N merges. No corpus
   statistics are needed at run time. For vocabularies trained with Hugging Face `tokenizers` (and
   tiktoken-style ranks) the ids are assigned in this order anyway;
3. token id, for tokenizers without merges.

Whatever the ranking, the chat format's own tokens are always kept: the stop ids (`<|role_end|>`,
eos), the think and role tags, and every token of a rendered sample conversation's scaffolding, so the
draft can propose the end of a turn. Ids past the tokenizer's vocabulary (embedding padding) rank last.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DEFAULT_DRAFT_VOCAB = 32768  # rows of the draft's head: 4.8x fewer bytes than Ling's 157,184
RANKING_FILE = "draft_vocab.json"
RANKING_ENV = "SPARKCHAT_DRAFT_RANKING"
# Ling's chat format and tool calls (shared/ling3-flash.md), kept whenever the tokenizer has them
CHAT_TOKENS = ("<|endoftext|>", "<|role_end|>", "<role>", "</role>", "<think>", "</think>", "<tool_call>",
               "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def load_ranking_file(path: str | Path) -> list[int]:
    """Token ids, most frequent first, from a ranked-id file (JSON list / object, or plain text)."""
    from sparkchat.engine.errors import ModelError

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{p}: cannot read the draft vocabulary ranking ({e})") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        data = text.split()
    if isinstance(data, dict):
        data = data.get("ranked_ids")
    try:
        ids = [int(v) for v in data]
    except (TypeError, ValueError):
        raise ModelError(f"{p}: a draft vocabulary ranking is a list of token ids, most frequent first") from None
    return ids


def merge_ranking(tokenizer_json: dict[str, Any]) -> list[int] | None:
    """Vocabulary ids in BPE merge order (base alphabet first, by id), then vocabulary entries no merge
    made, then added tokens; None when the tokenizer is not BPE with merges."""
    model = tokenizer_json.get("model") or {}
    vocab, merges = model.get("vocab"), model.get("merges")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not merges:
        return None
    made: dict[int, int] = {}
    for i, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        tid = vocab.get(a + b)
        if tid is not None and tid not in made:
            made[tid] = i
    text = {t: s for s, t in vocab.items()}
    ids = sorted(text)
    base = [t for t in ids if t not in made and len(text[t]) == 1]
    base_set = set(base)
    by_merge = sorted(made, key=made.__getitem__)
    others = [t for t in ids if t not in made and t not in base_set]
    added = sorted({a["id"] for a in tokenizer_json.get("added_tokens") or [] if isinstance(a.get("id"), int)}
                   - set(text))
    return base + by_merge + others + added


def token_ranking(model_dir: str | Path | None, vocab_size: int) -> tuple[list[int], str]:
    """(every id in [0, vocab_size), most frequent first; where the ranking came from)."""
    ranked: list[int] | None = None
    source = "token id"
    env = os.environ.get(RANKING_ENV)
    if env:
        ranked, source = load_ranking_file(env), f"${RANKING_ENV} ({env})"
    elif model_dir is not None and (Path(model_dir) / RANKING_FILE).is_file():
        ranked, source = load_ranking_file(Path(model_dir) / RANKING_FILE), RANKING_FILE
    elif model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        try:
            tj = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            tj = {}
        ranked = merge_ranking(tj)
        if ranked is not None:
            source = "BPE merge order"
    return complete_ranking(ranked or [], vocab_size), source


def complete_ranking(ranked: Iterable[int], vocab_size: int) -> list[int]:
    """`ranked` without repeats or out-of-range ids, followed by every id it left out, by id."""
    seen: set[int] = set()
    out = []
    for t in ranked:
        if 0 <= t < vocab_size and t not in seen:
            seen.add(t)
            out.append(t)
    out += [t for t in range(vocab_size) if t not in seen]
    return out


def chat_token_ids(tokenizer) -> set[int]:
    """Ids the draft must always be able to propose: stop ids, the chat tags, and every token of the
    template's scaffolding around a sample conversation (thinking on and off)."""
    ids = set(tokenizer.stop_token_ids)
    for text in CHAT_TOKENS:
        tid = tokenizer.token_id(text)
        if tid is not None:
            ids.add(tid)
    sample = [{"role": "system", "content": "x"}, {"role": "user", "content": "x"},
              {"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
    for thinking in (True, False):
        try:
            ids.update(tokenizer.encode_chat(sample, enable_thinking=thinking))
        except Exception:  # a template that refuses the sample: the tags above still hold
            pass
    return ids


def draft_rows(ranking: list[int], n: int, always: Iterable[int], vocab_size: int) -> list[int] | None:
    """The draft head's N token ids: `always` (in range) first, then the best-ranked ids up to N in all;
    None when N covers the whole vocabulary (the draft then runs the full head)."""
    if n >= vocab_size:
        return None
    rows = {t for t in always if 0 <= t < vocab_size}
    for t in ranking:
        if len(rows) >= n:
            break
        rows.add(t)
    return sorted(rows)


def rank_corpus(tokenizer, texts: Iterable[str]) -> tuple[list[int], Counter]:
    """Token ids by their count over `texts` (most frequent first, ties by id), and the counts."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(tokenizer.encode(text))
    return sorted(counts, key=lambda t: (-counts[t], t)), counts


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sparkchat.engine.draft_vocab",
                                 description="Rank a model's tokens by their count in text files and write a "
                                             f"ranked-id file for the truncated draft head ({RANKING_FILE}).")
    ap.add_argument("--model", "-m", required=True, help="model directory (its tokenizer.json is used)")
    ap.add_argument("--out", "-o", help=f"where to write (default: stdout); put it in the model directory as "
                                        f"{RANKING_FILE}, or point ${RANKING_ENV} at it")
    ap.add_argument("files", nargs="+", help="text files (UTF-8) in the language and domain the model is used for")
    args = ap.parse_args(argv)
    from sparkchat.engine.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(args.model)
    texts = (Path(f).read_text(encoding="utf-8", errors="replace") for f in args.files)
    ranked, counts = rank_corpus(tok, texts)
    text = json.dumps({"ranked_ids": ranked, "tokens_counted": sum(counts.values()),
                       "source": [str(f) for f in args.files]})
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
