"""The embedded demo model (assets/demo): it loads through the fp4 release path, answers with real MTP
acceptance, and the MTP layer that tools/train_demo.py trains is the one the engine runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sparkchat.engine.checkpoint import read_header
from sparkchat.engine.events import SamplingParams
from sparkchat.engine.nn.linear import Linear
from sparkchat.engine.nn.moe import Experts

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo"
PROMPT = [{"role": "user", "content": "What does json.dumps do?"}]

pytestmark = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not built")


@pytest.fixture(scope="module")
def engine():
    from sparkchat.engine.session import Engine

    return Engine.load(DEMO, device="cpu", max_context=1024)


def _answer(engine, messages, max_tokens: int = 48, mtp: bool = True, thinking: bool = False):
    sw = engine.switches
    sw.mtp = mtp
    engine.set_switches(sw)
    engine.reset()
    ids = engine.tokenizer.encode_chat(messages, enable_thinking=thinking)
    text, tokens, last = "", [], None
    for ev in engine.generate_ids(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        text += ev.text
        tokens += ev.token_ids
        last = ev
    return text, tokens, last


def test_demo_answers_with_stats(engine):
    text, tokens, last = _answer(engine, PROMPT)
    stats = last.stats
    assert text.strip() and len(tokens) == stats.generated_tokens > 1
    assert stats.decode_tok_s > 0 and stats.prefill_tok_s > 0
    assert stats.switches["mtp"] is True
    assert stats.accept_length_mean is not None and stats.accept_length_mean >= 1.0
    assert len(stats.accept_rate_per_position) == engine.switches.draft_steps
    assert "json" in text.lower()  # it answers the question it was asked


def test_demo_thinking_mode_closes_its_thought(engine):
    text, _, _ = _answer(engine, PROMPT, max_tokens=96, thinking=True)
    assert "</think>" in text


def test_demo_speculative_greedy_equals_plain_greedy(engine):
    messages = [{"role": "user", "content": "Explain the with statement."}]
    _, plain, _ = _answer(engine, messages, max_tokens=40, mtp=False)
    _, spec, last = _answer(engine, messages, max_tokens=40, mtp=True)
    assert spec == plain
    assert last.stats.accept_length_mean > 1.0  # a trained draft: several tokens accepted per step


def test_demo_is_the_fp4_release_format(engine):
    raw = json.loads((DEMO / "config.json").read_text())
    assert raw["model_type"] == "bailing_hybrid" and raw["num_nextn_predict_layers"] == 1
    q = raw["quantization_config"]
    assert q["quant_method"] == "fp8" and q["routed_experts_quant_method"] == "mxfp4"
    assert engine.config.quantization is not None
    linears = {n: m for n, m in engine.model.named_modules() if isinstance(m, Linear)}
    assert linears
    for name, lin in linears.items():
        if name.endswith(".b_proj"):  # KDA's beta projection: left unquantized by the release, as in the real one
            assert not lin.is_fp8, name
        else:
            assert lin.is_fp8 and lin.weight.dtype == torch.float8_e4m3fn, name
    experts = [m for m in engine.model.modules() if isinstance(m, Experts)]
    assert len(experts) == sum(t == "sparse" for t in engine.config.mlp_layer_types) + 1  # + the MTP layer
    assert all(e.is_mxfp4 and e.w13.dtype == torch.uint8 for e in experts)
    assert engine.model.mtp is not None and engine.model.mtp.eh_proj.is_fp8
    dtypes = {}
    for f in DEMO.glob("*.safetensors"):
        dtypes.update({k: v["dtype"] for k, v in read_header(f).items() if k != "__metadata__"})
    assert dtypes["model.word_embeddings.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    assert dtypes["model.layers.0.attention.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.experts.0.gate_proj.weight"] in ("U8", "I8")


def test_demo_shape_and_size():
    raw = json.loads((DEMO / "config.json").read_text())
    from sparkchat.engine.config import ModelConfig

    cfg = ModelConfig.from_dict(raw)
    assert cfg.mla_layers and cfg.kda_layers  # hybrid attention
    assert cfg.mlp_layer_types[0] == "dense" and "sparse" in cfg.mlp_layer_types
    assert 1 < cfg.n_group and cfg.topk_group < cfg.n_group and cfg.num_shared_experts == 1
    assert cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0
    files = [p for p in DEMO.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 1024 * 1024
    assert all(p.stat().st_size <= 16 * 1024 * 1024 for p in files)
    from sparkchat.engine.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(DEMO)
    role_end = tok.token_id("<|role_end|>")
    assert role_end in set(raw["eos_token_id"]) and role_end in tok.stop_token_ids
    assert tok.render(PROMPT, enable_thinking=False).endswith("<role>ASSISTANT</role>\n<think></think>")


def _train_demo():
    pytest.importorskip("transformers.models.bailing_hybrid")
    if "train_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_demo"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules["train_demo"]


def test_training_mtp_layer_is_the_engines(tmp_path):
    """The MTP module trained in tools/train_demo.py, exported under the official names, computes what
    the engine's MTPLayer computes: the first draft step and a chained one."""
    td = _train_demo()
    from sparkchat.engine.config import ModelConfig
    from sparkchat.engine.loader import load_model
    from sparkchat.engine.release import save_safetensors_shards
    from sparkchat.engine.state import ConversationState

    spec = td.Spec(vocab_size=200, **td.TINY)
    model, mtp = td.build(spec, seed=5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for mod in (model, mtp):
            for name, p in mod.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
                elif p.ndim >= 2 and "conv" not in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            for name, b in mod.named_buffers():
                if "e_score_correction_bias" in name:
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.eval(), mtp.eval()
    save_safetensors_shards(tmp_path, td.official_tensors(model, mtp, spec))
    (tmp_path / "config.json").write_text(json.dumps(td.official_config(model, spec)))
    cfg = ModelConfig.from_dir(tmp_path)
    eng = load_model(tmp_path, cfg, "cpu", torch.float32, 64)
    T, n = 24, 12
    ids = torch.randint(7, 200, (1, T), generator=g)
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
        state = ConversationState.allocate(cfg, 64, "cpu", torch.float32)
        h_eng, _ = eng(ids[0], 0, state)
        torch.testing.assert_close(h_eng, h[0], rtol=1e-4, atol=1e-4)
        pe = model.model.rotary_emb(h, torch.arange(T - 2)[None])
        ours = mtp(model.model.embed_tokens(ids[:, 1:-1]), h[:, :-2], pe)  # depth 1, every slot
        theirs = eng.draft(ids[0, 1:n + 1], h_eng[:n], 0, state.mtp)  # slots 0..n-1
        torch.testing.assert_close(theirs, ours[0, :n], rtol=1e-4, atol=1e-4)
        # a chained step at slot n: the MTP output of slot n-1 stands in for the main hidden
        chained = eng.draft(ids[0, n + 1:n + 2], theirs[-1:], n, state.mtp)
        hin = torch.cat([h[:, :n], ours[:, n - 1:n]], dim=1)
        pe = model.model.rotary_emb(h, torch.arange(n + 1)[None])
        ours_chained = mtp(model.model.embed_tokens(ids[:, 1:n + 2]), hin, pe)[:, -1]
        torch.testing.assert_close(chained, ours_chained, rtol=1e-4, atol=1e-4)


def _demo_data():
    if "demo_data" not in sys.modules:
        spec = importlib.util.spec_from_file_location("demo_data", ROOT / "tools" / "demo_data.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["demo_data"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["demo_data"]


def test_demo_data_third_party_docstrings_are_cleaned():
    """reST/Sphinx markup becomes plain docstring text, and a C function's first-line signature is taken
    as its signature, not as text."""
    dd = _demo_data()

    def add():
        """add(input, other, *, alpha=1) -> Tensor

        Adds :attr:`other`, scaled by :attr:`alpha`, to ``input`` (see :func:`~torch.sub`).

        .. math::
            \\text{out}_i = \\text{input}_i + \\text{other}_i

        .. versionadded:: 2.1

        Example::

            >>> torch.add(a, 20)  # doctest: +SKIP
        """

    doc, sig = dd._pkg_doc(add, "add")
    assert sig == "(input, other, *, alpha=1) -> Tensor"
    assert doc.startswith("Adds `other`, scaled by `alpha`, to `input` (see `sub`).")
    assert "math" not in doc and "\\text" not in doc and "doctest" not in doc
    assert "New in version 2.1." in doc and "Example:\n\n    >>> torch.add(a, 20)" in doc
    # a C function has no inspectable signature: the one from its docstring names it
    assert dd._pkg_signature(object(), "torch.add", "add", sig) == "torch.add(input, other, *, alpha=1) -> Tensor"
    item = dd._pkg_function("torch.add", "add", add, "torch", "torch")
    assert item.chunks[0].startswith("`torch.add()` is a function in the `torch` module.\n\nAdds `other`")
    assert item.source == "torch" and item.kind == "function"


def test_demo_data_takes_only_permissive_dependencies():
    dd = _demo_data()
    mit = dd.Package("x", ("x",), "MIT")
    assert dd.licence_ok(mit, "MIT; MIT License")
    assert not dd.licence_ok(mit, "MPL-2.0 AND MIT")  # tqdm
    assert not dd.licence_ok(mit, "BSD-3-Clause")
    assert not dd.licence_ok(dd.Package("x", ("x",), "GPL-3.0"), "GPL-3.0")
    deps = dd._dependency_closure(ROOT)
    assert {"jinja2", "rich", "textual", "pytest"} <= deps and "sparkchat" not in deps
    for pkg in dd.PACKAGES:
        assert pkg.licence.startswith(dd._PERMISSIVE), pkg.dist


def test_demo_data_short_answers_restate_the_name():
    """The short examples answer with the header that names the asked object (and maybe one sentence)."""
    import random

    dd = _demo_data()
    item = dd.DocItem("rich.text.Text.copy", "method", "rich.text.Text.copy",
                      ["`rich.text.Text.copy(self) -> Text` is a method of `rich.text.Text`.\n\nReturn a copy "
                       "of this instance. The copy shares no state.\n\nArgs:\n    none."],
                      "The user asks about rich.text.Text.copy, a method of the rich.text.Text class. I will "
                      "explain what it does.", source="rich")
    rng = random.Random(0)
    for _ in range(20):
        ex = dd._short_example(item, rng)
        answer = ex.completion.split("</think>")[-1].strip()
        assert answer.startswith("`rich.text.Text.copy(self) -> Text` is a method of `rich.text.Text`.")
        assert answer.endswith("<|role_end|>") and "Args" not in answer
        assert "rich.text.Text.copy" in ex.messages[-1]["content"]
    train, valid, test = dd.split_items([item])
    assert len(train) + len(valid) + len(test) == 1


def test_training_rows_pack_whole_examples(tmp_path):
    import numpy as np

    td = _train_demo()
    tokens = np.arange(100, 100 + 30, dtype=np.uint16)
    index = np.array([[0, 2, 5], [5, 3, 10], [15, 1, 4], [19, 2, 11]], dtype=np.int64)  # (start, prompt, length)
    np.savez(tmp_path / "s.npz", tokens=tokens, index=index)
    split = td.Split(tmp_path / "s.npz")
    ids, w = split.rows([1, 0, 2, 3], seq_len=16, pad=6)
    assert ids.shape == (2, 16)  # [ex1 + ex0 (15 tokens)] [ex2 + ex3 (15 tokens)]
    assert ids[0, :10].tolist() == list(range(105, 115)) and ids[0, 10:15].tolist() == list(range(100, 105))
    assert ids[0, 15] == 6 and ids[1, :4].tolist() == list(range(115, 119))
    assert w[0, :10].tolist() == [0.0] * 3 + [1.0] * 7 and w[0, 10:15].tolist() == [0.0] * 2 + [1.0] * 3
    assert w[0, 15] == 0 and w[1].sum() == 3 + 9


def test_eval_counts_answers_that_name_the_asked_object():
    td = _train_demo()
    rec = {"key": "json.dumps", "name": "json.dumps", "kind": "function"}
    assert td._names_the_object(rec, "`json.dumps(obj, *, skipkeys=False)` is a function in the `json` module.")
    assert td._names_the_object(rec, "The user asks about json.dumps.\n</think>\n\n`json.dumps(obj)` is ...")
    assert not td._names_the_object(rec, "`json.loads(s)` is a function in the `json` module.")
    assert td._names_the_object({"key": "module:json"}, "`json` is a module of the Python standard library.")
    assert td._names_the_object({"key": "topic:with"}, "anything") is None
