"""Chat data for the embedded demo model, built offline from the documentation of the Python that runs it.

Sources (all permissively licensed; see docs/demo-model.md):
- `pydoc_data.topics`: the language-reference topics that `help("with")` prints (PSF License Agreement);
- docstrings of the standard library's modules, classes, functions and methods, read with `inspect`;
- docstrings of the installed third-party packages in PACKAGES that are dependencies of sparkchat or its
  tests (so `pip install -e '.[test]'` puts them there) and whose metadata declares the permissive licence
  listed for them (MIT, BSD, Apache-2.0, PSF). Each package is imported in its own child process, with a
  time limit, offline, in a scratch directory; modules that fail to import are skipped. The package's
  name, version and licence are recorded in meta.json.

Each documented object becomes question → answer pairs in Ling's chat format ("What does json.dumps do?"
→ its signature and docstring; "Explain the "with" statement." → the topic text), plus a short answer
("Which module is json.dumps in?" → the one-line header that names it). Objects are split into train,
valid (checkpoint choice) and test (the documented figures) by a hash of their answer, so no held-out
answer text is ever trained on.

    python tools/demo_data.py OUT_DIR    # tokenizer files, {train,valid,test}.npz, test.jsonl, meta.json
    python tools/demo_data.py OUT_DIR --packages none          # the standard library only
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
# the same questions with the name split into its module (or class) and its last part
SPLIT_QUESTIONS = {
    "function": ["What does {a} in {m} do?", "What does the {a} function from {m} do?", "In {m}, what is {a} for?",
                 "Explain the function {a} of the {m} module."],
    "method": ["What does the {a} method of {m} do?", "What does {a} do on a {m}?", "Explain {m}'s {a} method."],
    "class": ["What is the {a} class in {m}?", "What is {a} from the {m} module?", "In {m}, what is {a}?"],
    "module": ["What is the {a} submodule of {m}?", "What does {m}'s {a} module provide?"],
}
# short answers: the header line that names the object (with its signature), or that plus one sentence
WHERE_QUESTIONS = {
    "function": ["Which module is {n} in?", "Where does {n} come from?", "What is the signature of {n}?",
                 "What arguments does {n} take?", "How do I call {n}?"],
    "method": ["Which class does {n} belong to?", "What is the signature of {n}?", "What arguments does {n} take?",
               "How do I call {n}?"],
    "class": ["Which module defines {n}?", "Where does the {n} class come from?", "What kind of object is {n}?"],
    "module": ["Where does the {n} module come from?", "Is {n} part of the standard library?",
               "What kind of module is {n}?"],
}
BRIEF_QUESTIONS = ["In one sentence, what does {n} do?", "Briefly, what is {n}?", "Give me a one-line summary of {n}.",
                   "What is {n}, in short?", "Summarize {n} in one sentence."]
SHORT_PER_ITEM = 0.7  # the chance that an object also gets one short question


@dataclass
class DocItem:
    key: str  # unique: "json.dumps", "topic:with"
    kind: str  # "function", "method", "class", "module", "topic"
    name: str  # what questions call it: "json.dumps", 'the "with" statement'
    chunks: list[str]  # the answer, in one or more parts (topics are long)
    thought: str  # the short reasoning the thinking mode writes first
    keywords: list[str] = field(default_factory=list)  # topics: keywords that lead to them
    source: str = "python"  # "python" (CPython's own documentation) or the third-party distribution's name


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


def _without_addresses(sig: str) -> str:
    """Default values whose repr is a memory address (sentinels, functions) by name; "" if any remain. The
    addresses change from run to run and mean nothing to a reader."""
    sig = re.sub(r"<([\w.]+) object at 0x[0-9a-fA-F]+>", lambda m: m.group(1).rsplit(".", 1)[-1] + "()", sig)
    sig = re.sub(r"<(?:function|built-in function|bound method) ([\w.]+) at 0x[0-9a-fA-F]+>", r"\1", sig)
    return "" if " at 0x" in sig else sig


def _signature(obj: Any, name: str) -> str:
    try:
        sig = _without_addresses(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return f"{name}(...)"
    return f"{name}{sig}" if sig and len(sig) <= 160 else f"{name}(...)"


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


# --- third-party packages -----------------------------------------------------------------------

# The third-party sources, chosen for docstring quality: user-facing APIs with prose docstrings. Left out:
# transformers (generated model docstrings), setuptools (patches distutils on import, vendors other
# licences), tqdm (MPL-2.0), regex (CNRI-Python), and the maths-heavy sympy/mpmath (mostly formulas and
# doctest numbers).
@dataclass(frozen=True)
class Package:
    dist: str
    roots: tuple[str, ...]
    licence: str  # an SPDX id (or classifier word) that the installed metadata must contain
    walk: bool = True
    skip: tuple[str, ...] = ()  # dotted module prefixes never imported
    alias: dict[str, str] = field(default_factory=dict)  # objects from a private package shown under a public one
    skip_objects: str = ""  # a regex of full names left out (legacy aliases whose docs repeat others')


_TORCH_MODULES = (
    "torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.nn.utils", "torch.nn.utils.rnn",
    "torch.nn.utils.parametrize", "torch.nn.attention", "torch.optim", "torch.optim.lr_scheduler",
    "torch.optim.swa_utils", "torch.autograd", "torch.autograd.functional", "torch.autograd.forward_ad",
    "torch.autograd.graph", "torch.utils.data", "torch.utils.checkpoint", "torch.utils.hooks", "torch.linalg",
    "torch.fft", "torch.special", "torch.random", "torch.amp", "torch.cuda", "torch.cuda.amp", "torch.backends",
    "torch.func", "torch.hub", "torch.serialization", "torch.testing", "torch.profiler", "torch.sparse",
    "torch.nested", "torch.masked", "torch.signal.windows", "torch.distributions", "torch.overrides",
    "torch.types", "torch.library", "torch.mps", "torch.cpu", "torch.accelerator", "torch.export",
)

PACKAGES: tuple[Package, ...] = (
    Package("torch", _TORCH_MODULES, "BSD-3-Clause", walk=False,
            skip_objects=r"^torch\.(cuda\.)?(?!Tensor$)\w*(Tensor|Storage)$"),  # torch.FloatTensor, ...
    Package("numpy", ("numpy",), "BSD-3-Clause",
            skip=("numpy.f2py", "numpy.distutils", "numpy.testing", "numpy.conftest", "numpy.compat",
                  "numpy.core", "numpy.matlib", "numpy.char", "numpy.ma.timer_comparison", "numpy.typing.mypy_plugin")),
    Package("networkx", ("networkx",), "BSD-3-Clause", skip=("networkx.conftest",)),
    Package("huggingface_hub", ("huggingface_hub",), "Apache-2.0"),
    Package("textual", ("textual",), "MIT"),
    Package("rich", ("rich",), "MIT"),
    Package("jinja2", ("jinja2",), "BSD"),
    Package("markupsafe", ("markupsafe",), "BSD-3-Clause"),
    Package("pygments", ("pygments",), "BSD-2-Clause", skip=("pygments.sphinxext",)),
    Package("pytest", ("pytest",), "MIT", alias={"_pytest": "pytest"}),
    Package("pluggy", ("pluggy",), "MIT"),
    Package("iniconfig", ("iniconfig",), "MIT"),
    Package("pydantic", ("pydantic",), "MIT", skip=("pydantic.v1", "pydantic.mypy", "pydantic.deprecated")),
    Package("click", ("click",), "BSD-3-Clause"),
    Package("typer", ("typer",), "MIT"),
    Package("anyio", ("anyio",), "MIT"),
    Package("h11", ("h11",), "MIT"),
    Package("httpx2", ("httpx2",), "BSD-3-Clause"),
    Package("httpcore2", ("httpcore2",), "BSD-3-Clause"),
    Package("fsspec", ("fsspec",), "BSD-3-Clause", skip=("fsspec.gui", "fsspec.fuse")),
    Package("filelock", ("filelock",), "MIT"),
    Package("platformdirs", ("platformdirs",), "MIT"),
    Package("packaging", ("packaging",), "BSD-2-Clause"),
    Package("idna", ("idna",), "BSD-3-Clause"),
    Package("markdown-it-py", ("markdown_it",), "MIT"),
    Package("mdit-py-plugins", ("mdit_py_plugins",), "MIT"),
    Package("linkify-it-py", ("linkify_it",), "MIT"),
    Package("pyyaml", ("yaml",), "MIT"),
    Package("tokenizers", ("tokenizers",), "Apache"),
    Package("safetensors", ("safetensors",), "Apache", skip=("safetensors.flax", "safetensors.mlx",
                                                              "safetensors.paddle", "safetensors.tensorflow")),
    Package("syrupy", ("syrupy",), "Apache-2.0"),
    Package("annotated-types", ("annotated_types",), "MIT"),
    Package("typing-inspection", ("typing_inspection",), "MIT"),
    Package("typing_extensions", ("typing_extensions",), "PSF-2.0"),
)

_PERMISSIVE = ("MIT", "BSD", "Apache", "PSF")
_COPYLEFT = ("GPL", "LGPL", "AGPL", "MPL", "EPL", "CDDL", "EUPL", "OSL", "SSPL", "CC-BY-SA")
_SKIP_PARTS = {"test", "tests", "testing", "conftest", "__main__", "setup", "benchmarks", "benchmark",
               "examples", "example", "demo", "vendor", "vendored", "_vendor", "compat"}
_SKIP_DOCS = ("Initialize self.", "Create and return a new object.", "Return repr(self).", "An enumeration.",
              "Method generated by attrs", "Alias for field number", "Create new instance of",
              "Helper for pickle.", "Return self", "Implement ", "Built-in mutable sequence.")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_ROLE = re.compile(r":(?:[\w-]+:)*([\w-]+):`([^`]+)`")


def _dependency_closure(root: Path) -> set[str]:
    """Normalized names of every distribution that `pip install -e '.[test]'` pulls in (installed ones)."""
    import importlib.metadata as md
    import tomllib

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    seen: set[tuple[str, str]] = set()  # (name, extra): markdown-it-py[linkify] pulls in more than markdown-it-py
    while todo:
        req = todo.pop()
        key = _norm(req.name)
        if {(key, e) for e in ("", *req.extras)} <= seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        seen |= {(key, e) for e in ("", *req.extras)}
        for raw in dist.requires or []:
            sub = Requirement(raw)
            env = {**default_environment(), "extra": ""}
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return {name for name, _ in seen}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _licence(dist: str) -> str:
    """What the installed metadata says: License-Expression, else License, else the licence classifiers."""
    import importlib.metadata as md

    meta = md.distribution(dist).metadata
    text = meta.get("License-Expression") or ""
    if not text and meta.get("License") and len(meta["License"]) < 100:
        text = meta["License"]
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(t for t in [text.strip(), *classifiers] if t)


def licence_ok(pkg: Package, declared: str) -> bool:
    """The declared licence names the permissive one we list for the package, and nothing copyleft."""
    up = declared.upper()
    return pkg.licence.upper() in up and pkg.licence.startswith(_PERMISSIVE) and \
        not any(re.search(rf"\b{c}\b", up) for c in _COPYLEFT)


def _rst_to_text(doc: str) -> str:
    """Sphinx/reST and Hugging Face doc markup → plain docstring text: roles become `code`, math and image
    blocks go, notes and version notes become sentences, code blocks stay."""
    lines, out, i = doc.split("\n"), [], 0
    while i < len(lines):
        line = lines[i]
        m = _DIRECTIVE.match(line)
        if m or re.match(r"^\s*\.\.(\s|$)", line):  # a directive, a comment or a link target: take its block
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                j += 1
            block = lines[i + 1:j]
            name, arg = (m.group(2), m.group(3).strip()) if m else ("", "")
            pad = " " * indent
            if name in ("note", "warning", "tip", "important", "hint", "caution", "attention", "seealso"):
                label = "See also" if name == "seealso" else name.capitalize()
                out.append(f"{pad}{label}:" + (f" {arg}" if arg else ""))
                out.extend(block)
            elif name in ("versionadded", "versionchanged", "deprecated"):
                word = {"versionadded": "New in version", "versionchanged": "Changed in version",
                        "deprecated": "Deprecated since version"}[name]
                version, _, rest = arg.partition(" ")
                out.append(f"{pad}{word} {version}" + (f": {rest}" if rest else "."))
                out.extend(block)
            elif name in ("code-block", "code", "sourcecode", "doctest", "testcode", "highlight"):
                out.extend(block)
            i = j
            continue
        if re.match(r"^\s*</?(Tip|Note|Warning|Deprecated)\b[^>]*>\s*$", line):
            i += 1
            continue
        out.append(line)
        i += 1
    text = "\n".join(out)

    def role(m: re.Match) -> str:
        kind, body = m.group(1), m.group(2)
        title = re.match(r"^(.*?)\s*<[^<>]+>$", body, re.S)
        if kind in ("ref", "doc", "term"):
            return title.group(1) if title and title.group(1) else body.lstrip("~")
        if title and title.group(1):
            body = title.group(1)
        if body.startswith("~"):
            body = body[1:].rsplit(".", 1)[-1]
        return f"`{body.lstrip('!')}`"

    text = _ROLE.sub(role, text)
    text = re.sub(r"^(\s*):param\s+(?:[^:\n]+\s)?(\w+):", r"\1\2:", text, flags=re.M)  # field lists
    text = re.sub(r"^(\s*):returns?:", r"\1Returns:", text, flags=re.M)
    text = re.sub(r"^(\s*):raises?\s+([^:\n]+):", r"\1Raises \2:", text, flags=re.M)
    text = re.sub(r"^[ \t]*:(?:type\s+\w+|rtype):.*\n?", "", text, flags=re.M)
    text = re.sub(r"\[`~?([^`\]]+)`\]", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`"
                  if m.group(0).startswith("[`~") else f"`{m.group(1)}`", text)  # [`HfApi`], [`~utils.X`]
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"(`[^`\n]+`)\[[\w.]+\]", r"\1", text)  # mkdocs cross-references: `X`[pkg.X]
    text = re.sub(r"\[([^\]\n]+)\]\((?!https?:)[^)\s]*\)", r"\1", text)  # relative Markdown links
    text = re.sub(r"[ \t]*#\s*(?:x?doctest|type: ?ignore|noqa)\b[^\n]*", "", text)  # tool directives in examples
    text = re.sub(r"^[ \t]*(=|~|\*|\^|#){3,}[ \t]*$\n?", "", text, flags=re.M)  # title over/underlines
    text = re.sub(r"(\S)::[ \t]*$", r"\1:", text, flags=re.M)  # "Example::" introduces a literal block
    text = re.sub(r"^[ \t]*::[ \t]*$\n?", "", text, flags=re.M)
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _pkg_doc(obj: Any, attr: str) -> tuple[str, str | None]:
    """(cleaned docstring, signature taken from its first line or None). A first line such as
    "add(input, other, *, alpha=1, out=None) -> Tensor" (C functions) is a signature, not text."""
    raw = getattr(obj, "__doc__", None)
    if not isinstance(raw, str):
        return "", None
    doc = _rst_to_text(_clean(raw))
    sig = None
    if attr and doc.startswith(attr + "("):  # the signature, maybe over several lines, then maybe "-> type"
        depth = 0
        for end, ch in enumerate(doc[:400]):
            depth += (ch == "(") - (ch == ")")
            if depth == 0 and ch == ")":
                line_end = doc.find("\n", end)
                line_end = len(doc) if line_end < 0 else line_end
                ret = doc[end + 1:line_end].strip()
                if not ret or ret.startswith("->"):
                    sig = re.sub(r"\s+", " ", doc[len(attr):end + 1]).replace("( ", "(").replace(", )", ")")
                    sig += f" {ret}" if ret else ""
                    doc = doc[line_end:].strip()
                break
    if doc.startswith(_SKIP_DOCS) or len(doc) < 20 or \
            re.match(r"^(See|Alias for|Same as|In-place version of)\b[^\n]{0,80}$", doc):  # a cross-reference
        return "", sig
    letters = sum(c.isalpha() or c == " " for c in doc[:MAX_ANSWER_CHARS])
    if letters < 0.6 * min(len(doc), MAX_ANSWER_CHARS):  # mostly formulas, numbers or tables
        return "", sig
    return doc, sig


def _pkg_signature(obj: Any, full: str, attr: str, from_doc: str | None) -> str:
    """The signature as inspect shows it; without annotations when that is too long; else from the doc."""
    try:
        sig = inspect.signature(obj)
        text = str(sig)
        # too long, or annotations with metadata objects (whose reprs carry addresses): names and defaults
        if len(text) > 160 or "Annotated[" in text or " at 0x" in text:
            bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
            text = str(sig.replace(parameters=bare, return_annotation=sig.empty))
    except (TypeError, ValueError, RuntimeError):
        text = from_doc or ""
    text = _without_addresses(text)
    for _ in range(2):  # stringized annotations: x: 'int', -> "'list[str]'"
        text = re.sub(r"""(: |-> )(["'])(.*?)\2(?=[,)=\s\]]|$)""", r"\1\3", text)
    if not text or len(text) > 160:
        return f"{full}(...)"
    return f"{full}{text}"


def _pkg_function(full: str, attr: str, obj: Any, owner: str, source: str) -> DocItem | None:
    doc, sig = _pkg_doc(obj, attr)
    if not doc:
        return None
    head = f"`{_pkg_signature(obj, full, attr, sig)}` is a function in the `{owner}` module."
    thought = f"The user asks about {full}, a function in the {owner} module. I will give its signature " \
              f"and explain what it does."
    return DocItem(full, "function", full, [_truncate(f"{head}\n\n{doc}")], thought, source=source)


def _pkg_class(full: str, cls: type, owner: str, package: str, source: str) -> list[DocItem]:
    """The class and its documented methods: its own, and those of private base classes from the same
    package (torch.Tensor's methods live on torch._C.TensorBase)."""
    items: list[DocItem] = []
    members: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        mod = getattr(base, "__module__", "") or ""
        private_base = base.__name__.startswith("_") or any(p.startswith("_") for p in mod.split(".")[1:])
        if base is cls or (private_base and base in cls.__bases__ and mod.split(".")[0] == package):
            members.update(vars(base))
    methods = []
    for attr, raw in sorted(members.items()):
        if attr.startswith("_"):
            continue
        bound = raw
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
            bound = getattr(cls, attr, raw)  # its signature without cls
        if not callable(raw) or inspect.isclass(raw):
            continue
        methods.append(attr)
        mdoc, sig = _pkg_doc(raw, attr)
        if not mdoc:
            continue
        name = f"{full}.{attr}"
        head = f"`{_pkg_signature(bound, name, attr, sig)}` is a method of `{full}`."
        thought = f"The user asks about {name}, a method of the {full} class. I will explain what it does."
        items.append(DocItem(name, "method", name, [_truncate(f"{head}\n\n{mdoc}")], thought, source=source))
    doc, _ = _pkg_doc(cls, cls.__name__)
    if doc:
        head = f"`{full}` is a class in the `{owner}` module."
        thought = f"The user asks about {full}, a class in the {owner} module. I will explain what it represents."
        tail = _listing("Its methods include", methods)
        items.insert(0, DocItem(full, "class", full, [_truncate(f"{head}\n\n{doc}") + tail], thought,
                                source=source))
    return items


def _walk(root: str, skip: tuple[str, ...]) -> list[str]:
    """root and its public submodules (no private, test or skipped ones), found without importing them."""
    mod = _import(root)
    if mod is None:
        return []
    names = [root]
    for info in sorted(pkgutil.iter_modules(getattr(mod, "__path__", []) or [], prefix=root + "."),
                       key=lambda i: i.name):
        last = info.name.rsplit(".", 1)[-1]
        if last.startswith("_") or last in _SKIP_PARTS or info.name.startswith(skip):
            continue
        names.extend(_walk(info.name, skip) if info.ispkg else [info.name])
    return names


def collect_package(pkg: Package) -> dict[str, Any]:
    """Every documented public module, class (with methods) and function of an installed package, each named
    by its shortest public path (json-able: runs in a child process)."""
    names: list[str] = []
    for root in pkg.roots:
        names += _walk(root, pkg.skip) if pkg.walk else [root]
    names = sorted(dict.fromkeys(n for n in names if not n.startswith(pkg.skip)),
                   key=lambda n: (n.count("."), n))
    items: list[DocItem] = []
    seen: set[int] = set()
    failed, imported = [], 0
    for modname in names:
        mod = _import(modname)
        if mod is None:
            failed.append(modname)
            continue
        imported += 1
        package = modname.split(".")[0]
        doc, _ = _pkg_doc(mod, "")
        if len(doc) >= 40:
            if "." in modname:
                head = f"`{modname}` is a module of the `{package}` package."
                what = f"a module of the {package} package"
            else:
                head, what = f"`{modname}` is the top-level module of the `{pkg.dist}` package.", \
                    f"the top-level module of the {pkg.dist} package"
            members = sorted(a for a in _public(mod) if callable(getattr(mod, a, None)))
            items.append(DocItem(f"module:{modname}", "module", modname,
                                 [_truncate(f"{head}\n\n{doc}") + _listing("It provides", members)],
                                 f"The user asks about {modname}, {what}. I will summarize what it provides.",
                                 source=pkg.dist))
        owners = [modname] + [priv for priv, pub in pkg.alias.items() if pub == modname]
        for attr in sorted(_public(mod)):  # __all__ may be built from a set: its order changes between runs
            try:
                obj = getattr(mod, attr, None)
                owner = getattr(obj, "__module__", None)
            except Exception:  # noqa: BLE001 - lazy attributes that fail are skipped
                continue
            if obj is None or id(obj) in seen or not isinstance(owner, str) or inspect.ismodule(obj):
                continue
            if not any(owner == o or owner.startswith(o + ".") for o in owners):
                continue
            seen.add(id(obj))
            full = f"{modname}.{attr}"
            if pkg.skip_objects and re.match(pkg.skip_objects, full):
                continue
            try:
                if inspect.isclass(obj):
                    items.extend(_pkg_class(full, obj, modname, package, pkg.dist))
                elif inspect.isroutine(obj) or type(obj).__name__ == "ufunc":
                    item = _pkg_function(full, attr, obj, modname, pkg.dist)
                    if item:
                        items.append(item)
            except Exception:  # noqa: BLE001 - odd objects (descriptors, proxies) are skipped
                continue
    return {"items": [vars(i) for i in items], "modules": imported, "failed": failed}


def _collect_in_child(pkg: Package, timeout: float) -> dict[str, Any]:
    """collect_package in a fresh interpreter: offline, in a scratch directory, with its own caches, killed
    after timeout seconds; whatever the imports do stays there."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "HF_HOME": f"{tmp}/hf", "XDG_CACHE_HOME": f"{tmp}/cache", "MPLBACKEND": "Agg",
               "MPLCONFIGDIR": f"{tmp}/mpl", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
               "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}  # set and dict reprs in the same order every build
        dst = Path(tmp) / "items.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--collect-package", pkg.dist, "--to", str(dst)]
        try:
            run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout,
                                 stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if run.returncode != 0 or not dst.is_file():
            return {"error": (run.stderr or run.stdout).strip().splitlines()[-1:] or f"exit {run.returncode}"}
        return json.loads(dst.read_text())


def collect_packages(names: list[str] | None, root: Path, timeout: float = 600.0,
                     workers: int = 2) -> tuple[list[DocItem], dict[str, Any]]:
    """Items of the PACKAGES (or those named) that are installed dependencies with their listed licence."""
    import importlib.metadata as md
    from concurrent.futures import ThreadPoolExecutor

    deps = _dependency_closure(root)
    chosen, report = [], {}
    for pkg in PACKAGES:
        if names is not None and pkg.dist not in names:
            continue
        try:
            version = md.version(pkg.dist)
        except md.PackageNotFoundError:
            report[pkg.dist] = {"skipped": "not installed"}
            continue
        declared = _licence(pkg.dist)
        info = {"version": version, "licence": pkg.licence, "declared_licence": declared}
        if _norm(pkg.dist) not in deps:
            report[pkg.dist] = {**info, "skipped": "not a dependency of sparkchat[test]"}
        elif not licence_ok(pkg, declared):
            report[pkg.dist] = {**info, "skipped": "licence is not the permissive one listed"}
        else:
            report[pkg.dist] = info
            chosen.append(pkg)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = list(pool.map(lambda p: _collect_in_child(p, timeout), chosen))
    items: list[DocItem] = []
    for pkg, res in zip(chosen, results):
        if "error" in res:
            report[pkg.dist]["skipped"] = f"collection failed: {res['error']}"
            continue
        got = [DocItem(**d) for d in res["items"]]
        items += got
        report[pkg.dist].update(modules=res["modules"], modules_failed=len(res["failed"]), objects=len(got))
    return items, report


# --- questions and examples -------------------------------------------------------------------


def _question(item: DocItem, rng: random.Random, extended: bool = True) -> str:
    """A question about item in one of its phrasings. extended=False keeps to the original phrasings (and
    random draws), so the held-out prompts of the standard library stay those of earlier builds."""
    if item.kind == "topic" and item.keywords and rng.random() < 0.4:
        templates, name = KEYWORD_QUESTIONS, f"`{rng.choice(item.keywords)}`"
    elif extended and item.kind != "topic" and "." in item.name and rng.random() < 0.2:
        owner, _, last = item.name.rpartition(".")
        template = rng.choice(SPLIT_QUESTIONS[item.kind])
        a = f"`{last}`" if rng.random() < 0.3 else last
        m = f"`{owner}`" if rng.random() < 0.3 else owner
        return _vary(template.format(a=a, m=m), rng)
    else:
        templates = {"function": FUNCTION_QUESTIONS, "method": METHOD_QUESTIONS, "class": CLASS_QUESTIONS,
                     "module": MODULE_QUESTIONS, "topic": TOPIC_QUESTIONS}[item.kind]
        name = item.name
        if item.kind in ("function", "method") and rng.random() < 0.2:
            name += "()"
        if item.kind != "topic" and rng.random() < 0.15:
            name = f"`{name}`"
    return _vary(rng.choice(templates).format(n=name), rng)


def _vary(q: str, rng: random.Random) -> str:
    if rng.random() < 0.15:
        q = q[0].lower() + q[1:]
    if rng.random() < 0.1:
        q = q.rstrip("?.")
    return q


def _summary(body: str, most: int = 300) -> str | None:
    """The first sentence of the first paragraph (on one line), if there is a short one."""
    para = " ".join(body.split("\n\n", 1)[0].split())
    m = re.match(rf"^(.{{20,{most}}}?[.!?])(\s|$)", para)
    if m:
        return m.group(1)
    return para if 20 <= len(para) <= most else None


def _short_example(item: DocItem, rng: random.Random) -> Example | None:
    """"Which module is json.dumps in?" → the header line alone; "Briefly, what is json.dumps?" → the header
    line and the docstring's first sentence. Both restate the asked name, which is what held-out answers
    most need to get right."""
    head, _, body = item.chunks[0].partition("\n\n")
    summary = _summary(body)
    name = item.name if rng.random() < 0.85 else f"`{item.name}`"
    if summary and rng.random() < 0.5:
        question, answer = rng.choice(BRIEF_QUESTIONS).format(n=name), f"{head}\n\n{summary}"
    else:
        question, answer = rng.choice(WHERE_QUESTIONS[item.kind]).format(n=name), head
    thought = item.thought.split(". ")[0] + ". I will answer briefly."
    thinking = rng.random() < 0.5
    return Example([{"role": "user", "content": _vary(question, rng)}], thinking,
                   _completion(answer, thought, thinking), item.key)


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
        if item.kind != "topic" and rng.random() < SHORT_PER_ITEM:
            out.append(_short_example(item, rng))
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


def encode_examples(tok, examples: list[Example],
                    seq_len: int) -> tuple[list[int], list[tuple[int, int, int]], list[int]]:
    """Flat token ids, (start, prompt_len, length) per example, and which examples were kept; examples
    longer than seq_len are dropped."""
    flat: list[int] = []
    index: list[tuple[int, int, int]] = []
    kept: list[int] = []
    prompts = tok.encode_batch([render(e.messages, e.thinking) for e in examples], add_special_tokens=False)
    completions = tok.encode_batch([e.completion for e in examples], add_special_tokens=False)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids = p.ids + c.ids
        if len(ids) > seq_len:
            continue
        index.append((len(flat), len(p.ids), len(ids)))
        kept.append(i)
        flat.extend(ids)
    return flat, index, kept


def _heldout_examples(items: list[DocItem], rng: random.Random) -> list[Example]:
    """One single-turn question per held-out item, thinking off: the answer is the whole completion."""
    return [Example([{"role": "user", "content": _question(i, rng, extended=False)}], False,
                    _completion(i.chunks[0], i.thought, False), i.key) for i in items]


def prepare(out: Path, vocab_size: int = 8192, seq_len: int = 1024, seed: int = 0,
            packages: list[str] | None = None, workers: int = 2) -> dict[str, Any]:
    """Everything training needs, written to out: tokenizer files, {train,valid,test}.npz, test.jsonl and
    meta.json. packages: the PACKAGES to take (None: all of them, []: none)."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    items = collect_topics() + collect_library()
    package_items, package_report = ([], {}) if packages == [] else \
        collect_packages(packages, Path(__file__).resolve().parents[1], workers=workers)
    items += package_items  # after the standard library: its held-out objects and prompts stay as they were
    train_items, valid_items, test_items = split_items(items)
    rng = random.Random(seed)
    train = make_examples(train_items, rng)
    valid = _heldout_examples(valid_items, random.Random(seed + 1))
    test = _heldout_examples(test_items, random.Random(seed + 2))
    texts = [render(e.messages, e.thinking) + e.completion for e in train]
    tok = train_tokenizer(texts, vocab_size)
    specials = write_tokenizer_files(tok, out)
    sources = ["python"] + [p.dist for p in PACKAGES if p.dist in package_report]
    source_of = {i.key: i.source for i in items}
    by_source: dict[str, dict[str, Any]] = {s: {} for s in sources}
    for name, group in (("items", items), ("train_items", train_items), ("valid_items", valid_items),
                        ("test_items", test_items)):
        for i in group:
            by_source[i.source][name] = by_source[i.source].get(name, 0) + 1
    stats: dict[str, Any] = {"python": sys.version.split()[0], "items": len(items),
                             "train_items": len(train_items), "valid_items": len(valid_items),
                             "test_items": len(test_items),
                             "vocab_size": tok.get_vocab_size(), "special_ids": specials, "seq_len": seq_len,
                             "kinds": {k: sum(i.kind == k for i in items) for k in
                                       ("topic", "module", "class", "function", "method")}}
    for name, examples in (("train", train), ("valid", valid), ("test", test)):
        flat, index, kept = encode_examples(tok, examples, seq_len)
        src = np.asarray([sources.index(source_of[examples[k].key]) for k in kept], dtype=np.uint8)
        np.savez_compressed(out / f"{name}.npz", tokens=np.asarray(flat, dtype=np.uint16),
                            index=np.asarray(index, dtype=np.int64), source=src)
        stats[f"{name}_examples"] = len(index)
        stats[f"{name}_tokens"] = len(flat)
        stats[f"{name}_completion_tokens"] = int(sum(n - p for _, p, n in index))
        for (_, p, n), s in zip(index, src.tolist()):
            key = f"{name}_completion_tokens"
            by_source[sources[s]][key] = by_source[sources[s]].get(key, 0) + int(n - p)
    kinds = {i.key: i.kind for i in items}
    names = {i.key: i.name for i in items}
    with (out / "test.jsonl").open("w") as f:
        for e in test:
            answer = e.completion.removesuffix(ROLE_END).strip()
            f.write(json.dumps({"key": e.key, "name": names[e.key], "kind": kinds[e.key],
                                "source": source_of[e.key], "messages": e.messages, "answer": answer}) + "\n")
    stats["sources"] = sources
    stats["by_source"] = {s: {**package_report.get(s, {}), **by_source[s]} for s in sources}
    stats["packages_left_out"] = {k: v for k, v in package_report.items() if "skipped" in v}
    (out / "meta.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packages", default="all",
                    help="third-party packages to take: all (of PACKAGES), none, or a comma-separated list")
    ap.add_argument("--workers", type=int, default=2, help="packages collected at once (one process each)")
    ap.add_argument("--collect-package", help=argparse.SUPPRESS)  # the child process of collect_packages
    ap.add_argument("--to", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.collect_package:
        pkg = next(p for p in PACKAGES if p.dist == args.collect_package)
        with contextlib.redirect_stdout(io.StringIO()):
            result = collect_package(pkg)
        args.to.write_text(json.dumps(result))
        return
    if args.out is None:
        ap.error("OUT_DIR is required")
    packages = None if args.packages == "all" else [] if args.packages == "none" else \
        [p.strip() for p in args.packages.split(",") if p.strip()]
    print(json.dumps(prepare(args.out, args.vocab_size, args.seq_len, args.seed, packages, args.workers), indent=2))


if __name__ == "__main__":
    main()
