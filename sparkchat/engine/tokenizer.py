"""Tokenizer, chat template and streaming detokenizer for a model directory.

    tok = ChatTokenizer.from_dir("path/to/model")
    ids = tok.encode_chat([{"role": "user", "content": "hi"}], enable_thinking=False)
    stream = tok.stream_decoder()
    for token_id in generated:
        print(stream.push(token_id), end="")
    print(stream.flush())

Only data files are read from the model directory (tokenizer.json, tokenizer_config.json,
chat_template.jinja, config.json, generation_config.json): never Python. The chat template runs in
Jinja's immutable sandbox with the helpers transformers gives templates (raise_exception, strftime_now,
tojson), so a template written for transformers renders the same here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import Tokenizer

from sparkchat.engine.errors import ModelError, TemplateError

ROLE_END = "<|role_end|>"
_REPLACEMENT = "\ufffd"  # what a byte-level decode yields for bytes that are not (yet) a whole character


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in path, None when the file is absent; ModelError when it is unreadable."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot read JSON ({_one_line(e)})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _token_ids(value: Any) -> set[int]:
    """eos_token_id as configs write it: an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any, where: Path) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} where "default" wins."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ModelError(f"{where}: chat_template list has no 'default' template")
    raise ModelError(f"{where}: chat_template must be a string or a list of named templates")


# --- the template environment -------------------------------------------------------------------


class _TemplateRaised(Exception):
    """raise_exception() called by the template: the template itself refuses the conversation."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON, as transformers gives.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, but touching an unsafe attribute fails at once instead of yielding a silent ''."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def compile_chat_template(source: str, origin: str = "chat template") -> jinja2.Template:
    """Compile a chat template in the sandbox; TemplateError (naming origin) when it does not parse."""
    env = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True,
                               extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"{origin}: syntax error on line {e.lineno}: {_one_line(e.message or e)}") from None
    except Exception as e:  # anything else the parser or an extension raises
        raise TemplateError(f"{origin}: cannot compile ({type(e).__name__}: {_one_line(e)})") from None


# --- the tokenizer ------------------------------------------------------------------------------


class ChatTokenizer:
    """A `tokenizers` tokenizer plus the model's chat template and stop tokens."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, *, template_origin: str = "chat template",
                 special_tokens: dict[str, str] | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._template_origin = template_origin
        self._template = compile_chat_template(chat_template, template_origin)
        # bos_token, eos_token, ... as strings: templates use them by these names
        self._special_tokens = dict(special_tokens or {})
        stop = set(eos_token_ids)
        for text in (self._special_tokens.get("eos_token"), ROLE_END):
            tid = tokenizer.token_to_id(text) if text else None
            if tid is not None:
                stop.add(tid)
        self._stop_token_ids = frozenset(stop)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        """Load tokenizer.json, the chat template and the eos ids from a model directory."""
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelError(f"{tok_path}: not found (the model directory needs a tokenizer.json)")
        try:
            tokenizer = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises a bare Exception for bad files
            raise ModelError(f"{tok_path}: cannot load ({_one_line(e)})") from None

        config_path = model_dir / "tokenizer_config.json"
        tok_config = _read_json(config_path) or {}
        jinja_path = model_dir / "chat_template.jinja"
        # transformers writes the template to its own file and that file wins over tokenizer_config.json
        if jinja_path.is_file():
            try:
                template, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
            except (OSError, UnicodeDecodeError) as e:
                raise ModelError(f"{jinja_path}: cannot read ({_one_line(e)})") from None
        else:
            template, origin = _pick_template(tok_config.get("chat_template"), config_path), str(config_path)
        if template is None or not template.strip():
            raise ModelError(f"{model_dir}: no chat template (neither chat_template.jinja nor "
                             f"'chat_template' in tokenizer_config.json)")

        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(tok_config.get(key))
            if text is not None:
                special[key] = text
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            eos |= _token_ids((_read_json(model_dir / name) or {}).get("eos_token_id"))
        return cls(tokenizer, template, template_origin=origin, special_tokens=special, eos_token_ids=eos)

    # --- plain tokenization

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, specials included (the model's embedding may be padded larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> set[int]:
        """Ids that end generation: config and generation_config eos ids, the eos token, `<|role_end|>`."""
        return set(self._stop_token_ids)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<think>"), None when it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in it map to their ids, nothing is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens included as written."""
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental decoder for one answer."""
        return StreamDecoder(self.decode)

    # --- chat

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for messages ({"role": "system"|"user"|"assistant", "content": ...})."""
        context = dict(self._special_tokens)
        context.update(messages=messages, tools=tools, documents=None,
                       add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise TemplateError(f"the chat template refused the conversation: {_one_line(e)}") from None
        except Exception as e:  # security errors, undefined values, type errors inside the template
            detail = _one_line(e) or type(e).__name__
            raise TemplateError(f"{self._template_origin}: rendering failed: {detail}") from None

    def encode_chat(self, messages: list[dict[str, Any]], *, enable_thinking: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered prompt, ending with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                       tools=tools))


class StreamDecoder:
    """Turns generated ids into text pieces as they arrive, never splitting a UTF-8 character.

    Keeps a small window: ids[prefix:read] were already emitted and are decoded again only as left
    context (decoders such as Metaspace treat a sequence's first token differently); ids[read:] are
    pending. A decode that ends in U+FFFD means the last character's bytes are incomplete, so it waits.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # only the window: older ids are dropped once emitted
        self._read = 0  # ids[:read] are emitted; ids[0] starts at a character boundary
        self._prefix_text: str | None = ""  # decode(ids[:read]), cached while waiting

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still incomplete)."""
        self._ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        piece = text[len(self._prefix_text):]
        # slide the window: what was pending becomes the new left context
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None
        return piece

    def flush(self) -> str:
        """Whatever is still pending at the end (incomplete bytes come out as U+FFFD, as decode gives)."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        piece = self._decode(self._ids)[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return piece
