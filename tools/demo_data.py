"""Chat data for the embedded demo model, built offline from the documentation that ships with CPython.

Sources (PSF License Agreement, Python's own licence; see docs/demo-model.md):
- `pydoc_data.topics`: the language-reference topics that `help("with")` prints;
- docstrings of the standard library's modules, classes, functions and methods, read with `inspect`.

Each documented object becomes question → answer pairs in Ling's chat format ("What does json.dumps do?"
→ its signature and docstring; "Explain the "with" statement." → the topic text). Objects are split into
train, valid (checkpoint choice) and test (the documented figures) by a hash of their answer, so no
held-out answer text is ever trained on.

    python tools/demo_data.py OUT_DIR    # tokenizer files, {train,valid,test}.npz, test.jsonl, meta.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import pkgutil
import random
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkchat.engine.chat_format import CHAT_TEMPLATE, EOS, PAD, ROLE_END, SPECIAL_TOKENS  # noqa: F401

MAX_ANSWER_CHARS = 1100
TEST_PERCENT = 3  # held out for the figures in docs/demo-model.md
VALID_PERCENT = 2  # held out for choosing the checkpoint

# Modules never imported: they open windows or browsers, print on import, or are platform-specific.
_SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
    "pydoc_data", "test", "msvcrt", "winreg", "winsound", "nt", "_winapi", "msilib", "distutils",
    "encodings", "xxsubtype", "xxlimited", "xxlimited_35", "__phello__", "_msi", "_overlapped",
    "sre_compile", "sre_constants", "sre_parse", "asynchat", "asyncore", "imp", "smtpd",
}
_SKIP_SUBPACKAGE_PARTS = {"test", "tests", "idle_test", "__main__"}
_SUBPACKAGE_ROOTS = (
    "json", "email", "xml", "urllib", "http", "logging", "concurrent", "importlib", "unittest", "asyncio",
    "collections", "multiprocessing", "sqlite3", "dbm", "wsgiref", "xmlrpc", "html", "zoneinfo", "os",
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are the sparkchat demo model. You answer questions about Python.",
    "Answer questions about the Python standard library.",
    "You are a concise technical assistant.",
]

FUNCTION_QUESTIONS = [
    "What does {n} do?", "What is {n} used for?", "Explain {n}.", "How do I use {n}?", "Tell me about {n}.",
    "What does the function {n} do?", "Can you explain what {n} does?", "Describe {n}.",
]
METHOD_QUESTIONS = [
    "What does {n} do?", "What does the {n} method do?", "Explain {n}.", "How do I use {n}?",
    "Tell me about {n}.", "What is {n} for?", "Describe the method {n}.",
]
CLASS_QUESTIONS = [
    "What is {n}?", "What is the {n} class?", "Explain the {n} class.", "Tell me about {n}.",
    "What is {n} used for?", "Describe {n}.", "How do I use the {n} class?",
]
MODULE_QUESTIONS = [
    "What is the {n} module?", "What does the {n} module do?", "Tell me about the {n} module.",
    "What is {n} for?", "Explain the {n} module.", "Which module is {n} and what does it provide?",
]
TOPIC_QUESTIONS = ["Explain {n}.", "Tell me about {n}.", "Describe {n}.", "What should I know about {n}?",
                   "Can you explain {n} in Python?"]
KEYWORD_QUESTIONS = ["What does the {n} keyword do?", "Explain the {n} keyword.", "How is {n} used in Python?"]
MORE_QUESTIONS = ["Tell me more.", "Go on.", "Continue, please.", "What else?", "More details, please."]


@dataclass
class DocItem:
    key: str  # unique: "json.dumps", "topic:with"
    kind: str  # "function", "method", "class", "module", "topic"
    name: str  # what questions call it: "json.dumps", 'the "with" statement'
    chunks: list[str]  # the answer, in one or more parts (topics are long)
    thought: str  # the short reasoning the thinking mode writes first
    keywords: list[str] = field(default_factory=list)  # topics: keywords that lead to them


@dataclass
class Example:
    messages: list[dict[str, str]]  # the conversation up to the last user turn
    thinking: bool
    completion: str  # what the model writes after the generation prompt, ending with <|role_end|>
    key: str


# --- collecting documented objects ------------------------------------------------------------


def _clean(doc: str | None) -> str:
    if not doc:
        return ""
    text = inspect.cleandoc(doc).strip()
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text


def _truncate(text: str, limit: int = MAX_ANSWER_CHARS) -> str:
    """Whole paragraphs up to limit chars; a first paragraph that is too long is cut at a sentence end."""
    if len(text) <= limit:
        return text
    out = ""
    for para in text.split("\n\n"):
        if len(out) + len(para) + 2 > limit:
            break
        out = f"{out}\n\n{para}" if out else para
    if out:
        return out
    head = text[:limit]
    cut = max(head.rfind(". "), head.rfind(".\n"))
    return head[: cut + 1] if cut > limit // 3 else head.rsplit(" ", 1)[0] + " ..."


def _chunks(text: str, limit: int = MAX_ANSWER_CHARS, most: int = 3) -> list[str]:
    parts: list[str] = []
    rest = text
    while rest and len(parts) < most:
        piece = _truncate(rest, limit)
        parts.append(piece)
        rest = rest[len(piece):].lstrip("\n")
        if piece.endswith(" ..."):
            break
    return parts


def _signature(obj: Any, name: str) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return f"{name}(...)"
    return f"{name}{sig}" if len(sig) <= 160 else f"{name}(...)"


def _import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module that fails to import is simply skipped
            return None


def _module_names() -> list[str]:
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES)
    extra: list[str] = ["os.path"]
    for root in _SUBPACKAGE_ROOTS:
        mod = _import(root)
        if mod is None or not hasattr(mod, "__path__"):
            continue
        for info in pkgutil.iter_modules(mod.__path__, prefix=root + "."):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in _SKIP_SUBPACKAGE_PARTS for p in parts):
                continue
            extra.append(info.name)
    return names + sorted(set(extra))


def _public(mod: Any) -> list[str]:
    names = getattr(mod, "__all__", None)
    if not isinstance(names, (list, tuple)):
        names = [n for n in dir(mod) if not n.startswith("_")]
    return [n for n in names if isinstance(n, str) and not n.startswith("_")]


def _listing(lead: str, names: list[str], most: int = 12) -> str:
    """A closing line such as "Its methods include `append`, `clear` and `copy`."."""
    if not names:
        return ""
    shown = [f"`{n}`" for n in names[:most]]
    more = " among others" if len(names) > most else ""
    joined = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    return f"\n\n{lead} {joined}{more}."


def _describe_function(name: str, obj: Any, owner: str) -> DocItem | None:
    doc = _clean(getattr(obj, "__doc__", None))
    if len(doc) < 20:
        return None
    head = f"`{_signature(obj, name)}` is a function in the `{owner}` module." if owner != "builtins" else \
        f"`{_signature(obj, name)}` is a built-in function."
    thought = (f"The user asks about {name}, a function in the {owner} module. I will give its signature "
               f"and explain what it does." if owner != "builtins" else
               f"The user asks about {name}, a built-in function. I will give its signature and explain it.")
    return DocItem(name, "function", name, [_truncate(f"{head}\n\n{doc}")], thought)


def _describe_class(name: str, cls: type, owner: str) -> list[DocItem]:
    items: list[DocItem] = []
    doc = _clean(cls.__doc__)
    if len(doc) >= 20 and doc != _clean(type.__doc__) and doc != _clean(object.__doc__):
        where = "a built-in type" if owner == "builtins" else f"a class in the `{owner}` module"
        head = f"`{name}` is {where}."
        thought = (f"The user asks about {name}, "
                   f"{'a built-in type' if owner == 'builtins' else 'a class in the ' + owner + ' module'}. "
                   f"I will explain what it represents.")
        methods = [a for a, v in sorted(vars(cls).items()) if not a.startswith("_") and callable(v)]
        tail = _listing("Its methods include", methods)
        items.append(DocItem(name, "class", name, [_truncate(f"{head}\n\n{doc}") + tail], thought))
    for attr, raw in sorted(vars(cls).items()):
        if attr.startswith("_"):
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if not callable(raw):
            continue
        mdoc = _clean(getattr(raw, "__doc__", None))
        if len(mdoc) < 20:
            continue
        full = f"{name}.{attr}"
        head = f"`{_signature(raw, full)}` is a method of `{name}`."
        thought = f"The user asks about {full}, a method of the {name} class. I will explain what it does."
        items.append(DocItem(full, "method", full, [_truncate(f"{head}\n\n{mdoc}")], thought))
    return items


def collect_library() -> list[DocItem]:
    """Modules, their public classes (with methods) and functions, and the builtins."""
    items: list[DocItem] = []
    seen: set[int] = set()
    for modname in ["builtins"] + _module_names():
        mod = _import(modname)
        if mod is None:
            continue
        real = mod.__name__
        if modname != "builtins":
            doc = _clean(mod.__doc__)
            members = [a for a in _public(mod) if callable(getattr(mod, a, None))
                       and getattr(getattr(mod, a), "__module__", None) == real]
            if len(doc) >= 40:
                thought = f"The user asks about {modname}, a module of the Python standard library. " \
                          f"I will summarize what it provides."
                head = f"`{modname}` is a module of the Python standard library."
                tail = _listing("It provides", members)
                items.append(DocItem(f"module:{modname}", "module", modname,
                                     [_truncate(f"{head}\n\n{doc}") + tail], thought))
        for attr in _public(mod):
            obj = getattr(mod, attr, None)
            if obj is None or id(obj) in seen or getattr(obj, "__module__", None) != real:
                continue
            seen.add(id(obj))
            name = attr if modname == "builtins" else f"{modname}.{attr}"
            if inspect.isclass(obj):
                items.extend(_describe_class(name, obj, modname))
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                item = _describe_function(name, obj, modname)
                if item:
                    items.append(item)
    return items


def collect_topics() -> list[DocItem]:
    """pydoc's language-reference topics, named by their heading, with the keywords that lead to them."""
    import pydoc
    from pydoc_data.topics import topics

    keywords: dict[str, list[str]] = {}
    for kw, target in pydoc.Helper.keywords.items():
        label = target[0] if isinstance(target, tuple) else target
        if label in topics:
            keywords.setdefault(label, []).append(kw)
    items = []
    for label, text in sorted(topics.items()):
        lines = text.strip("\n").split("\n")
        if len(lines) > 2 and set(lines[1].strip()) <= {"*", "=", "-"} and lines[1].strip():
            title, body = lines[0].strip(), "\n".join(lines[2:]).strip()
        else:
            title, body = label.replace("-", " "), text.strip()
        name = title[0].lower() + title[1:] if title[:4] == "The " else title
        body = re.sub(r"\n{3,}", "\n\n", body)
        chunks = _chunks(body)
        if not chunks or len(chunks[0]) < 40:
            continue
        thought = f"The user asks about {name}, a topic of the Python language reference. I will explain it."
        items.append(DocItem(f"topic:{label}", "topic", name, chunks, thought, keywords.get(label, [])))
    return items


# --- questions and examples -------------------------------------------------------------------


def _question(item: DocItem, rng: random.Random) -> str:
    if item.kind == "topic" and item.keywords and rng.random() < 0.4:
        templates, name = KEYWORD_QUESTIONS, f"`{rng.choice(item.keywords)}`"
    else:
        templates = {"function": FUNCTION_QUESTIONS, "method": METHOD_QUESTIONS, "class": CLASS_QUESTIONS,
                     "module": MODULE_QUESTIONS, "topic": TOPIC_QUESTIONS}[item.kind]
        name = item.name
        if item.kind in ("function", "method") and rng.random() < 0.2:
            name += "()"
        if item.kind != "topic" and rng.random() < 0.15:
            name = f"`{name}`"
    q = rng.choice(templates).format(n=name)
    if rng.random() < 0.15:
        q = q[0].lower() + q[1:]
    if rng.random() < 0.1:
        q = q.rstrip("?.")
    return q


def _completion(answer: str, thought: str, thinking: bool) -> str:
    if thinking:
        return f"\n{thought}\n</think>\n\n{answer}{ROLE_END}"
    return f"\n\n{answer}{ROLE_END}"


def make_examples(items: list[DocItem], rng: random.Random, per_item: int = 2) -> list[Example]:
    """Single-turn questions for every item, follow-ups for long topics, and some two-topic chats."""
    out: list[Example] = []
    for item in items:
        for _ in range(per_item if item.kind != "topic" else 4):
            msgs = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.1 else []
            msgs.append({"role": "user", "content": _question(item, rng)})
            thinking = rng.random() < 0.5
            out.append(Example(msgs, thinking, _completion(item.chunks[0], item.thought, thinking), item.key))
        for k in range(1, len(item.chunks)):  # "Tell me more." follow-ups walk through a long topic
            msgs = [{"role": "user", "content": _question(item, rng)},
                    {"role": "assistant", "content": item.chunks[k - 1]},
                    {"role": "user", "content": rng.choice(MORE_QUESTIONS)}]
            thinking = rng.random() < 0.5
            thought = f"The user wants more about {item.name}. I will continue the explanation."
            out.append(Example(msgs, thinking, _completion(item.chunks[k], thought, thinking), item.key))
    # chats whose earlier turn is about something else: answers must follow the last question
    singles = [e for e in out if len(e.messages) == 1]
    for e in rng.sample(singles, k=len(singles) // 10):
        other = rng.choice(singles)
        earlier = other.completion.removesuffix(ROLE_END).split("</think>")[-1].strip()
        msgs = [other.messages[-1], {"role": "assistant", "content": earlier}, e.messages[-1]]
        out.append(Example(msgs, e.thinking, e.completion, e.key))
    rng.shuffle(out)
    return out


def split_items(items: list[DocItem]) -> tuple[list[DocItem], list[DocItem], list[DocItem]]:
    """(train, valid, test) by a hash of the answer text, after dropping duplicate answers (inherited
    docstrings), so no held-out answer is ever trained on."""
    by_answer: dict[str, DocItem] = {}
    for item in items:
        body = item.chunks[0].split("\n\n", 1)[-1]
        by_answer.setdefault(body, item)
    train, valid, test = [], [], []
    for body, item in by_answer.items():
        h = int(hashlib.sha256(body.encode()).hexdigest()[:8], 16) % 100
        (test if h < TEST_PERCENT else valid if h < TEST_PERCENT + VALID_PERCENT else train).append(item)
    return train, valid, test


# --- tokenizer --------------------------------------------------------------------------------


def render(messages: list[dict[str, str]], thinking: bool) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True,
                                                 enable_thinking=thinking)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(tok, out: Path) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json."""
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS,
              "pad_token": PAD, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[EOS], "eos_token_id": [ids[ROLE_END], ids[EOS]],
                  "pad_token_id": ids[PAD], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


# --- the whole pipeline -----------------------------------------------------------------------


def encode_examples(tok, examples: list[Example], seq_len: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Flat token ids and (start, prompt_len, length) per example; examples longer than seq_len are dropped."""
    flat: list[int] = []
    index: list[tuple[int, int, int]] = []
    prompts = tok.encode_batch([render(e.messages, e.thinking) for e in examples], add_special_tokens=False)
    completions = tok.encode_batch([e.completion for e in examples], add_special_tokens=False)
    for p, c in zip(prompts, completions):
        ids = p.ids + c.ids
        if len(ids) > seq_len:
            continue
        index.append((len(flat), len(p.ids), len(ids)))
        flat.extend(ids)
    return flat, index


def _heldout_examples(items: list[DocItem], rng: random.Random) -> list[Example]:
    """One single-turn question per held-out item, thinking off: the answer is the whole completion."""
    return [Example([{"role": "user", "content": _question(i, rng)}], False,
                    _completion(i.chunks[0], i.thought, False), i.key) for i in items]


def prepare(out: Path, vocab_size: int = 8192, seq_len: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Everything training needs, written to out: tokenizer files, {train,valid,test}.npz, test.jsonl."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    items = collect_topics() + collect_library()
    train_items, valid_items, test_items = split_items(items)
    rng = random.Random(seed)
    train = make_examples(train_items, rng)
    valid = _heldout_examples(valid_items, random.Random(seed + 1))
    test = _heldout_examples(test_items, random.Random(seed + 2))
    texts = [render(e.messages, e.thinking) + e.completion for e in train]
    tok = train_tokenizer(texts, vocab_size)
    specials = write_tokenizer_files(tok, out)
    stats: dict[str, Any] = {"python": sys.version.split()[0], "items": len(items),
                             "train_items": len(train_items), "valid_items": len(valid_items),
                             "test_items": len(test_items),
                             "vocab_size": tok.get_vocab_size(), "special_ids": specials, "seq_len": seq_len,
                             "kinds": {k: sum(i.kind == k for i in items) for k in
                                       ("topic", "module", "class", "function", "method")}}
    for name, examples in (("train", train), ("valid", valid), ("test", test)):
        flat, index = encode_examples(tok, examples, seq_len)
        np.savez_compressed(out / f"{name}.npz", tokens=np.asarray(flat, dtype=np.uint16),
                            index=np.asarray(index, dtype=np.int64))
        stats[f"{name}_examples"] = len(index)
        stats[f"{name}_tokens"] = len(flat)
        stats[f"{name}_completion_tokens"] = int(sum(n - p for _, p, n in index))
    with (out / "test.jsonl").open("w") as f:
        for e in test:
            answer = e.completion.removesuffix(ROLE_END).strip()
            f.write(json.dumps({"key": e.key, "messages": e.messages, "answer": answer}) + "\n")
    (out / "meta.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(prepare(args.out, args.vocab_size, args.seq_len, args.seed), indent=2))


if __name__ == "__main__":
    main()
