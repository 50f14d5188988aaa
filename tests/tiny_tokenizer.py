"""A tiny byte-level BPE tokenizer in Ling's chat format, trained offline, for tests and tiny models.

    from tests.tiny_tokenizer import write_test_tokenizer
    vocab = write_test_tokenizer(model_dir)          # tokenizer.json, tokenizer_config.json, generation_config.json

The specials match Ling's names so the engine's stop and thinking logic runs unchanged on tiny models.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparkchat.engine.chat_format import CHAT_TEMPLATE, EOS, PAD, ROLE_END, SPECIAL_TOKENS  # noqa: F401

# Small on purpose: training must stay well under a second. The non-English line (twice, so BPE merges
# it) makes some tokens hold part of a multi-byte character, which the stream decoder must handle.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model needs a tiny tokenizer.
Hello there! How are you today? I am fine, thank you, and how are you?
The engine reads the prompt, runs the layers and samples the next token.
Once upon a time there was a small chat app that talked to a large model on a small desk.
It answered questions about the weather, the time, the news and the meaning of words.
Think step by step: first read the question, then plan the answer, then write it down.
Numbers like 1, 2, 3, 10, 42 and 2025 appear in text too, as do symbols: + - * / = ( ) [ ] { }.
She said that the answer was correct, and he agreed that the answer was clear and short.
We test the tokenizer with short sentences, long sentences and everything in between.
A few borrowed words: café, naïve, résumé; 世界你好 means hello world, 世界 is the world; 👍 yes, 👍👍 🙂.
A few borrowed words: café, naïve, résumé; 世界你好 means hello world, 世界 is the world; 👍 yes, 👍👍 🙂.
"""


def _specials(vocab: dict[str, int]) -> dict[str, int]:
    return {tok: vocab[tok] for tok in SPECIAL_TOKENS}


def _train(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the byte alphabet plus specials "
                         f"({len(alphabet) + len(SPECIAL_TOKENS)})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
        min_frequency=1, show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


def write_test_tokenizer(model_dir: Path, vocab_size: int = 320) -> int:
    """Train and write a byte-level BPE tokenizer with Ling's specials and chat template into model_dir.

    Writes tokenizer.json, tokenizer_config.json (with the template) and generation_config.json;
    returns the real vocabulary size (specials included), which is at most vocab_size.
    """
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size)
    tok.save(str(model_dir / "tokenizer.json"))
    ids = _specials(tok.get_vocab(with_added_tokens=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,  # GPT-2 style: no separate bos token in this vocabulary
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": ids[EOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size <= vocab_size, (size, vocab_size)
    return size


def write_chat_template_file(model_dir: Path, vocab_size: int = 320) -> int:
    """Like write_test_tokenizer, but the template lives in chat_template.jinja, not tokenizer_config.json."""
    model_dir = Path(model_dir)
    size = write_test_tokenizer(model_dir, vocab_size)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config, indent=2))
    # Files on the Hub end with a newline; Jinja drops one trailing newline, as in transformers.
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE + "\n")
    return size
