"""ChatTokenizer: loading, encode/decode, the Ling chat format, the template sandbox, stream decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sparkchat.engine.errors import ModelError, TemplateError
from sparkchat.engine.tokenizer import ChatTokenizer, StreamDecoder
from tests.tiny_tokenizer import (
    CHAT_TEMPLATE, EOS, ROLE_END, SPECIAL_TOKENS, write_chat_template_file, write_test_tokenizer,
)

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello, how can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]
HISTORY = ("<role>SYSTEM</role>You are a helpful assistant.<|role_end|>"
           "<role>HUMAN</role>Hi!<|role_end|>"
           "<role>ASSISTANT</role>Hello, how can I help?<|role_end|>"
           "<role>HUMAN</role>What is 2+2?<|role_end|>")
MIXED = "naïve café 世界你好, means hello 👍🙂 and 👨‍👩‍👧 ok\n\tdone 🇯🇵 ∑x²"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(model_dir)


def _set_template(model_dir: Path, template: object) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))


# --- the test tokenizer itself


def test_write_test_tokenizer_respects_vocab_size(tmp_path: Path) -> None:
    size = write_test_tokenizer(tmp_path, vocab_size=300)
    tok = ChatTokenizer.from_dir(tmp_path)
    assert size == tok.vocab_size <= 300
    assert write_test_tokenizer(tmp_path / "b") == ChatTokenizer.from_dir(tmp_path / "b").vocab_size == 320


# --- encode / decode


@pytest.mark.parametrize("text", ["Hello there, how are you today?", "", "  leading and trailing  \n\n",
                                  MIXED, "<role>HUMAN</role>hi<|role_end|><think>hmm</think>yes"])
def test_encode_decode_round_trip(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok: ChatTokenizer) -> None:
    ids = {s: tok.token_id(s) for s in SPECIAL_TOKENS}
    assert None not in ids.values() and len(set(ids.values())) == len(SPECIAL_TOKENS)
    for s, i in ids.items():
        assert tok.encode(s) == [i]
    # inside text too, and nothing is added around it (no bos/eos)
    ids_text = tok.encode("ab<think>cd")
    assert ids_text.count(ids["<think>"]) == 1
    assert ids_text[0] != ids[EOS] and ids_text[-1] != ids[EOS]
    assert tok.decode([ids["<role>"], ids["</role>"]]) == "<role></role>"


def test_encode_adds_no_special_tokens(tmp_path: Path) -> None:
    # a tokenizer.json whose post-processor adds a bos token, as many do: encode() must not use it
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    write_test_tokenizer(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    eos_id = raw.token_to_id(EOS)
    raw.post_processor = TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, eos_id)])
    raw.save(str(tmp_path / "tokenizer.json"))
    assert raw.encode("hi").ids[0] == eos_id
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.encode("hi") == raw.encode("hi", add_special_tokens=False).ids
    assert eos_id not in tok.encode("hi") and tok.encode(EOS + "hi")[0] == eos_id


# --- the chat format


def test_render_thinking_on_and_off(tok: ChatTokenizer) -> None:
    on = tok.render(CONVERSATION)
    off = tok.render(CONVERSATION, enable_thinking=False)
    assert on == HISTORY + "<role>ASSISTANT</role>\n<think>"
    assert off == HISTORY + "<role>ASSISTANT</role>\n<think></think>"
    assert tok.render(CONVERSATION, add_generation_prompt=False) == HISTORY


def test_encode_chat_is_encoded_render(tok: ChatTokenizer) -> None:
    for thinking in (True, False):
        ids = tok.encode_chat(CONVERSATION, enable_thinking=thinking)
        assert ids == tok.encode(tok.render(CONVERSATION, enable_thinking=thinking))
        assert tok.decode(ids) == tok.render(CONVERSATION, enable_thinking=thinking)
    assert tok.encode_chat(CONVERSATION)[-1] == tok.token_id("<think>")
    assert tok.encode_chat(CONVERSATION, enable_thinking=False)[-1] == tok.token_id("</think>")
    assert tok.encode_chat(CONVERSATION).count(tok.token_id(ROLE_END)) == 4


def test_template_from_jinja_file(tmp_path: Path) -> None:
    write_chat_template_file(tmp_path)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    tok = ChatTokenizer.from_dir(tmp_path)
    # the file's trailing newline is dropped, as transformers' Jinja setup does
    assert tok.render(CONVERSATION) == HISTORY + "<role>ASSISTANT</role>\n<think>"


def test_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    write_chat_template_file(tmp_path)
    _set_template(tmp_path, "from tokenizer_config")
    assert ChatTokenizer.from_dir(tmp_path).render(CONVERSATION).startswith("<role>SYSTEM</role>")


def test_template_list_takes_default(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, [{"name": "tool_use", "template": "TOOLS"},
                             {"name": "default", "template": CHAT_TEMPLATE}])
    assert ChatTokenizer.from_dir(tmp_path).render(CONVERSATION) == HISTORY + "<role>ASSISTANT</role>\n<think>"


def test_template_context_and_helpers(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, "{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}"
                            "|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
                            "{% endfor %}|{% generation %}g{% endgeneration %}")
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.bos_token == EOS and tok.eos_token == EOS
    out = tok.render(CONVERSATION, tools=[{"name": "café", "n": 1}])
    assert out == f'{EOS}|{EOS}|[{{"name": "café", "n": 1}}]|4|system|g'


def test_trim_and_lstrip_blocks(tmp_path: Path) -> None:
    # block tags on their own lines leave no whitespace behind, as in transformers' environment
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n"
                            "    {% endif %}\n{% endfor %}\n")
    assert ChatTokenizer.from_dir(tmp_path).render(CONVERSATION) == "Hi!\nWhat is 2+2?\n"


def test_matches_transformers(model_dir: Path, tok: ChatTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    for thinking in (True, False):
        want = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=thinking)
        assert tok.render(CONVERSATION, enable_thinking=thinking) == want
        assert tok.encode(want) == hf.encode(want, add_special_tokens=False)
    assert tok.decode(tok.encode(MIXED)) == hf.decode(hf.encode(MIXED, add_special_tokens=False))


# --- the sandbox and template errors


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",  # plain Jinja sandbox would print '' here; we refuse outright
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",  # the immutable sandbox forbids mutation
    "{{ messages[0].clear() }}",
    "{{ raise_exception('only user and assistant roles') }}",
    "{{ 1 + 'a' }}",
    "{{ undefined_thing.attr }}",
])
def test_bad_templates_raise_template_error(tmp_path: Path, template: str) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, template)
    tok = ChatTokenizer.from_dir(tmp_path)
    with pytest.raises(TemplateError) as err:
        tok.render(CONVERSATION)
    assert "\n" not in str(err.value) and str(err.value)
    assert CONVERSATION[0]["content"] == "You are a helpful assistant." and len(CONVERSATION) == 4


def test_raise_exception_message_reaches_user(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, "{% if messages[0].role != 'user' %}{{ raise_exception('first\nmust be user') }}"
                            "{% endif %}ok")
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="first must be user"):
        tok.render(CONVERSATION)


def test_syntax_error_is_template_error(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, "{% for m in messages %}{{ m.content }")
    with pytest.raises(TemplateError) as err:
        ChatTokenizer.from_dir(tmp_path)
    assert "tokenizer_config.json" in str(err.value) and "\n" not in str(err.value)


# --- stop ids


def test_stop_token_ids(model_dir: Path, tok: ChatTokenizer) -> None:
    assert tok.stop_token_ids == {tok.token_id(EOS), tok.token_id(ROLE_END)}


def test_stop_token_ids_union_of_configs(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [250, 251]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 252}))
    tok = ChatTokenizer.from_dir(tmp_path)
    assert tok.stop_token_ids == {250, 251, 252, tok.token_id(EOS), tok.token_id(ROLE_END)}
    tok.stop_token_ids.add(7)  # a copy: callers cannot change the tokenizer's set
    assert 7 not in tok.stop_token_ids


# --- missing or broken files


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="tokenizer.json") as err:
        ChatTokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)


def test_broken_tokenizer_json(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer.json"):
        ChatTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("template", [None, "", [{"name": "tool_use", "template": "x"}]])
def test_missing_chat_template(tmp_path: Path, template: object) -> None:
    write_test_tokenizer(tmp_path)
    _set_template(tmp_path, template)
    with pytest.raises(ModelError, match="chat_template|tokenizer_config.json") as err:
        ChatTokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)


def test_broken_config_json(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(ModelError, match="config.json"):
        ChatTokenizer.from_dir(tmp_path)


# --- stream decoding


def _stream(tok: ChatTokenizer, ids: list[int]) -> tuple[list[str], str]:
    dec = tok.stream_decoder()
    return [dec.push(i) for i in ids], dec.flush()


# characters the corpus never saw come out as one token per byte
@pytest.mark.parametrize("text", [MIXED, "日本語のテキスト" * 5, "👍🙂🇯🇵🦀" * 10, "<think>日</think>本<|role_end|>"])
def test_stream_decode_never_splits_characters(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    assert tail == ""  # valid text ends on a whole character, so nothing is left for flush
    for piece in pieces:
        assert "\ufffd" not in piece
        assert piece.encode("utf-8").decode("utf-8") == piece
    # some token really did split a character (else this test proves nothing), and text still streamed
    assert "" in pieces and sum(1 for p in pieces if p) > 1


def test_stream_decode_piece_by_piece_is_prompt(tok: ChatTokenizer) -> None:
    # ASCII comes out token by token, with no holding back
    ids = tok.encode("the answer is 42")
    pieces, _ = _stream(tok, ids)
    assert pieces == [tok.decode([i]) for i in ids]


def test_stream_decode_random_ids_match_decode(tok: ChatTokenizer) -> None:
    # arbitrary ids (stray bytes, specials, invalid UTF-8): the pieces still add up to decode() exactly
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        pieces, tail = _stream(tok, ids)
        assert "".join(pieces) + tail == tok.decode(ids)


def test_stream_decode_flush_emits_incomplete_bytes(tok: ChatTokenizer) -> None:
    ids = tok.encode("ok 🦀")
    # drop the emoji's last byte token: decode() shows U+FFFD, and so must push+flush
    pieces, tail = _stream(tok, ids[:-1])
    assert tail.endswith("\ufffd")
    assert "".join(pieces) + tail == tok.decode(ids[:-1])


def test_stream_decode_window_stays_small(tok: ChatTokenizer) -> None:
    # the decoder must decode a sliding window, not the whole answer, for every token
    widths: list[int] = []

    def counting_decode(ids: list[int]) -> str:
        widths.append(len(ids))
        return tok.decode(ids)

    ids = tok.encode(MIXED * 30)
    dec = StreamDecoder(counting_decode)
    out = "".join(dec.push(i) for i in ids) + dec.flush()
    assert out == MIXED * 30
    assert len(ids) > 500 and max(widths) <= 16
    assert len(widths) <= 2 * len(ids) + 2
