"""Pieces transformers does not cover: the SwiGLU clamp, KDA prefill vs decode, absorbed vs expanded
MLA, multi-turn state reuse, and config parsing."""

from __future__ import annotations

import json

import pytest
import torch

from sparkchat.engine.config import ModelConfig
from sparkchat.engine.errors import ModelError
from sparkchat.engine.loader import load_model
from sparkchat.engine.nn.mla import MLACache, MultiLatentAttention, Span
from sparkchat.engine.nn.moe import swiglu
from sparkchat.engine.nn.rope import RotaryEmbedding
from sparkchat.engine.state import ConversationState
from tests.tiny import build_reference, save_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ref = build_reference(seed=11)
    path = save_reference(ref, tmp_path_factory.mktemp("u") / "m")
    return path


def _load(path, **cfg_overrides):
    cfg = ModelConfig.from_dir(path)
    for k, v in cfg_overrides.items():
        setattr(cfg, k, v)
    model = load_model(path, cfg, "cpu", torch.float32, 256)
    return model, cfg


def _state(cfg):
    return ConversationState.allocate(cfg, 256, "cpu", torch.float32)


def test_swiglu_clamp_values():
    gate = torch.tensor([-10.0, 0.0, 2.0, 10.0, 10.0])
    up = torch.tensor([1.0, 5.0, -9.0, 9.0, -0.5])
    out = swiglu(gate, up, limit=4.0)
    silu = torch.nn.functional.silu(gate)
    expected = torch.minimum(silu, torch.tensor(4.0)) * up.clamp(-4, 4)
    assert torch.allclose(out, expected)
    assert out[3].item() == pytest.approx(16.0)  # silu(10)≈10 → 4, up 9 → 4
    assert out[2].item() == pytest.approx(torch.nn.functional.silu(torch.tensor(2.0)).item() * -4)
    assert torch.allclose(swiglu(gate, up, 0.0), silu * up)  # limit 0 = no clamp


def test_clamp_limits_reach_the_experts(tiny, tmp_path):
    raw = json.loads((tiny / "config.json").read_text())
    raw["expert_swiglu_limit_list"] = [0, 0.05, 0, 0.05]
    raw["share_expert_swiglu_limit_list"] = [0, 0, 0.07, 0]
    cfg = ModelConfig.from_dict(raw)
    model = load_model(tiny, cfg, "cpu", torch.float32, 64)
    assert model.layers[1].mlp.experts.limit == 0.05 and model.layers[2].mlp.experts.limit == 0.0
    assert model.layers[2].mlp.shared_experts.limit == 0.07
    base, _ = _load(tiny)
    ids = torch.arange(2, 30)
    a = model.lm_head(model(ids, 0, _state(cfg))[0])
    b = base.lm_head(base(ids, 0, _state(cfg))[0])
    assert (a - b).abs().max() > 1e-3  # a tight clamp changes the output


@pytest.mark.parametrize("T", [1, 31, 33, 100])
@pytest.mark.parametrize("group", [1, 3, 64])
def test_kda_chunked_form_equals_the_recurrence(T, group):
    """The chunk-parallel form (any number of chunks at once, a partial last chunk padded) gives the
    recurrence's outputs and final state, strong decays (gate down to -5 a step) included."""
    from sparkchat.engine.nn.kda import kda_chunked, kda_recurrent, l2norm

    gen = torch.Generator().manual_seed(T * 7 + group)
    h, d = 3, 16
    q = l2norm(torch.randn(T, h, d, generator=gen)) * d ** -0.5
    k = l2norm(torch.randn(T, h, d, generator=gen))
    v = torch.randn(T, h, d, generator=gen)
    g = -5 * torch.rand(T, h, d, generator=gen)
    beta = torch.rand(T, h, generator=gen)
    S0 = 0.3 * torch.randn(h, d, d, generator=gen)
    o1, S1, _ = kda_recurrent(q, k, v, g, beta, S0)
    o2, S2 = kda_chunked(q, k, v, g, beta, S0, chunk=8, group=group)
    assert o2.shape == o1.shape
    assert ((o2 - o1).abs().max() / o1.abs().max()).item() < 1e-5
    assert ((S2 - S1).abs().max() / S1.abs().max()).item() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [300, 2048])
def test_kda_chunked_form_on_the_gpu_at_lings_shape(T):
    """On a GPU the chunked form runs chunk_group() chunks at once (16 at 32 heads × 128): same outputs
    and final state as the recurrence, and as a chunk at a time."""
    from sparkchat.engine.nn.kda import chunk_group, kda_chunked, kda_recurrent, l2norm

    gen = torch.Generator(device="cuda").manual_seed(T)
    h, d = 32, 128
    q = l2norm(torch.randn(T, h, d, generator=gen, device="cuda")) * d ** -0.5
    k = l2norm(torch.randn(T, h, d, generator=gen, device="cuda"))
    v = torch.randn(T, h, d, generator=gen, device="cuda")
    g = -2 * torch.rand(T, h, d, generator=gen, device="cuda")
    beta = torch.rand(T, h, generator=gen, device="cuda")
    S0 = 0.3 * torch.randn(h, d, d, generator=gen, device="cuda")
    group = chunk_group(q.device, h, d)
    assert group > 1
    o1, S1, _ = kda_recurrent(q, k, v, g, beta, S0)
    o2, S2 = kda_chunked(q, k, v, g, beta, S0, group=group)
    o3, S3 = kda_chunked(q, k, v, g, beta, S0, group=1)
    for o, S in ((o2, S2), (o3, S3)):
        assert ((o - o1).abs().max() / o1.abs().max()).item() < 1e-3
        assert ((S - S1).abs().max() / S1.abs().max()).item() < 1e-3


def test_kda_chunked_prefill_equals_token_by_token_decode(tiny):
    model, cfg = _load(tiny)
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    s1, s2 = _state(cfg), _state(cfg)
    prefill = model.lm_head(model(ids, 0, s1)[0])  # 70 tokens: chunked KDA, expanded MLA
    steps = torch.cat([model.lm_head(model(ids[i:i + 1], i, s2)[0]) for i in range(len(ids))])
    assert torch.allclose(prefill, steps, atol=1e-4, rtol=1e-4)
    for i in cfg.kda_layers:
        assert torch.allclose(s1.kda[i].recurrent, s2.kda[i].recurrent, atol=1e-5)
        assert torch.allclose(s1.kda[i].conv, s2.kda[i].conv, atol=1e-5)


def test_absorbed_mla_equals_expanded():
    torch.manual_seed(0)
    attn = MultiLatentAttention(hidden=48, heads=3, nope=16, rope=8, v_dim=12, rank=20, eps=1e-6)
    for lin in (attn.q_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.dense, attn.g_proj):
        lin.set_weight(torch.randn(lin.out_features, lin.in_features) * 0.2)
    rotary = RotaryEmbedding(8, 1e4, 64, None)
    x = torch.randn(9, 48)

    def run(absorbed: bool):
        cache = MLACache(torch.zeros(64, 20), torch.zeros(64, 8))
        first = attn(x[:6], Span.contiguous(0, 6, "cpu"), cache, rotary, absorbed=absorbed)
        second = attn(x[6:], Span.contiguous(6, 3, "cpu"), cache, rotary, absorbed=absorbed)
        return torch.cat([first, second])

    assert torch.allclose(run(True), run(False), atol=1e-5)


@pytest.mark.parametrize("start,T,attend", [(0, 7, 7), (5, 4, 9), (3, 2, 16)], ids=["from-0", "second-turn", "bucket"])
def test_prefill_attention_equals_explicit_softmax(start, T, attend):
    """The prompt's MLA attention (causal from position 0, masked after it, stale rows past the span
    masked) equals softmax(q k^T / sqrt) v written out, with q/k and v head sizes that differ."""
    from sparkchat.engine.nn.mla import prefill_attention

    g = torch.Generator().manual_seed(start + T)
    q, k, v = torch.randn(3, T, 24, generator=g), torch.randn(3, attend, 24, generator=g), torch.randn(3, attend, 16, generator=g)
    span = Span.contiguous(start, T, "cpu") if attend == start + T else Span(torch.arange(start, start + T), attend)
    scores = (q @ k.transpose(1, 2)) * 0.3
    seen = torch.arange(attend)[None, :] <= span.pos[:, None]
    want = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1) @ v
    assert torch.allclose(prefill_attention(q, k, v, span, 0.3), want, atol=1e-5)


def test_second_turn_prefills_only_new_tokens_and_matches_full_prefill(tiny):
    model, cfg = _load(tiny)
    g = torch.Generator().manual_seed(2)
    turn1 = torch.randint(0, cfg.vocab_size, (25,), generator=g)
    turn2 = torch.randint(0, cfg.vocab_size, (17,), generator=g)
    kept = _state(cfg)
    model(turn1, 0, kept)
    incremental = model.lm_head(model(turn2, 25, kept)[0])
    whole = model.lm_head(model(torch.cat([turn1, turn2]), 0, _state(cfg))[0])[25:]
    assert torch.allclose(incremental, whole, atol=1e-4, rtol=1e-4)


def test_a_prompt_sends_only_its_last_position_through_the_head(tiny):
    """generate_tokens needs the prompt's last logits only: the head must not see every prompt row (on
    the real vocabulary that is 0.6 MB of fp32 logits a prompt token), and the answer is the same."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.generate import generate_tokens

    model, cfg = _load(tiny)
    prompt = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    rows: list[int] = []
    real = model.lm_head.forward
    model.lm_head.forward = lambda h, draft=False: rows.append(h.shape[0]) or real(h, draft)
    out = [t for step in generate_tokens(model, _state(cfg), prompt, SamplingParams(max_tokens=3), set())
           for t in step.tokens]
    assert rows[0] == 1 and len(out) == 3
    model.lm_head.forward = real
    whole = model.lm_head(model(torch.tensor(prompt), 0, _state(cfg))[0])
    assert out[0] == int(whole[-1].argmax())


def test_engine_keeps_state_between_turns(tiny_model_dir):
    from sparkchat.engine.events import SamplingParams, Switches
    from sparkchat.engine.session import Engine

    engine = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    engine.set_switches(Switches(mtp=False, fp8_head=False))
    first_prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    first = list(engine.generate_ids(first_prompt, SamplingParams(max_tokens=6)))
    assert first[-1].stats.prefilled_tokens == len(first_prompt)
    kept = list(engine.state.token_ids)
    assert kept[: len(first_prompt)] == first_prompt and len(kept) > len(first_prompt)
    turn2 = kept + engine.tokenizer.encode("<|role_end|><role>HUMAN</role>and again<|role_end|>")
    reused = [e.token_ids for e in engine.generate_ids(turn2, SamplingParams(max_tokens=8))]
    assert list(engine.generate_ids(turn2, SamplingParams(max_tokens=1)))[-1].stats.prefilled_tokens == len(turn2)
    engine.reset()
    fresh = [e.token_ids for e in engine.generate_ids(turn2, SamplingParams(max_tokens=8))]
    assert reused == fresh  # reusing the kept state answers exactly as prefilling everything


def test_engine_prefills_only_the_new_turn(tiny_model_dir):
    from sparkchat.engine.events import SamplingParams, Switches
    from sparkchat.engine.session import Engine

    engine = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    engine.set_switches(Switches(mtp=False, fp8_head=False))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    list(engine.generate_ids(prompt, SamplingParams(max_tokens=6)))
    turn2 = list(engine.state.token_ids) + [7, 8, 9]
    stats = list(engine.generate_ids(turn2, SamplingParams(max_tokens=2)))[-1].stats
    assert stats.prefilled_tokens == 3 and stats.prompt_tokens == len(turn2)


def test_an_answers_stats_carry_the_bytes_a_token_reads_and_the_read_bandwidth(tiny_model_dir):
    from sparkchat.engine.events import SamplingParams, Switches
    from sparkchat.engine.session import Engine
    from sparkchat.engine.traffic import decode_bytes, read_bandwidth

    engine = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    sizes = {}
    for fp8 in (False, True):
        engine.set_switches(Switches(mtp=False, fp8_head=fp8))
        stats = list(engine.generate_ids(prompt, SamplingParams(max_tokens=2)))[-1].stats
        assert stats.bytes_per_token == decode_bytes(engine.model, len(prompt), fp8_head=fp8)
        assert stats.read_bw_bytes_s == read_bandwidth(engine.device) > 0
        sizes[fp8] = stats.bytes_per_token
    head = engine.model.lm_head.weight
    assert sizes[False] - sizes[True] == head.numel() * (head.element_size() - 1) - 4 * head.shape[0]


def test_the_read_bandwidth_steps_down_where_a_loaded_model_leaves_no_room(monkeypatch):
    """On a GPU nearly filled by the model, the 1 GiB buffer does not fit: 256 MiB then, else no
    figure (0.0) — never a failed load."""
    from sparkchat.engine import traffic

    tried = []

    def measure(device, nbytes, iters):
        tried.append(nbytes)
        if nbytes > room:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 4.0e12

    monkeypatch.setattr(traffic, "measure_read_bandwidth", measure)
    cuda = torch.device("cuda")
    for room, want, sizes in ((2 << 30, 4.0e12, [1 << 30]), (512 << 20, 4.0e12, [1 << 30, 256 << 20]),
                              (64 << 20, 0.0, [1 << 30, 256 << 20])):
        tried.clear()
        assert traffic.read_bandwidth.__wrapped__(cuda) == want and tried == sizes


def test_config_refuses_other_models():
    with pytest.raises(ModelError, match="unsupported model_type 'llama'"):
        ModelConfig.from_dict({"model_type": "llama"})
    ling26 = {"model_type": "bailing_hybrid", "hidden_size": 8}
    with pytest.raises(ModelError, match="Ling-2.6"):
        ModelConfig.from_dict(ling26)


def test_config_missing_key_and_derived_layers():
    base = {"model_type": "bailing_hybrid", "short_conv_kernel_size": 4}
    with pytest.raises(ModelError, match="missing required keys: hidden_size"):
        ModelConfig.from_dict(base)
    full = dict(base, hidden_size=2560, num_hidden_layers=42, num_attention_heads=32, vocab_size=157184,
                num_experts=512, num_experts_per_tok=8, moe_intermediate_size=768, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, eos_token_id=156895,
                expert_swiglu_limit_list=[0] * 35 + [4] * 7, num_nextn_predict_layers=1)
    cfg = ModelConfig.from_dict(full)
    assert cfg.mla_layers == [5, 11, 17, 23, 29, 35, 41]
    assert len(cfg.kda_layers) == 35
    assert cfg.mlp_layer_types[:3] == ["dense", "dense", "sparse"]
    assert cfg.expert_swiglu_limit_list[35] == 4.0 and cfg.share_expert_swiglu_limit_list == [0.0] * 42
    assert cfg.eos_token_id == [156895] and cfg.has_mtp
    with pytest.raises(ModelError, match="rope_scaling"):
        ModelConfig.from_dict(dict(full, rope_scaling={"rope_type": "longrope"}))


def test_fixed_bucket_span_equals_contiguous(tiny):
    """CUDA graphs attend over a fixed bucket of cache rows with positions as a tensor: same result."""
    model, cfg = _load(tiny)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    a, b = _state(cfg), _state(cfg)
    model(ids[:20], 0, a)
    model(ids[:20], 0, b)
    for pos in range(20, 30):
        x = ids[pos:pos + 1]
        ea = model.lm_head(model(x, pos, a)[0])
        eb = model.lm_head(model(x, pos, b, span=Span(torch.tensor([pos]), attend=128))[0])
        assert torch.allclose(ea, eb, atol=1e-5)


def test_memory_check_refuses_a_model_that_does_not_fit(tiny):
    from sparkchat.engine.checkpoint import CheckpointReader
    from sparkchat.engine.loader import resident_bytes

    cfg = ModelConfig.from_dir(tiny)
    need = resident_bytes(CheckpointReader(tiny, "cpu"), torch.float32, quantize_experts=False)
    on_disk = sum(f.stat().st_size for f in tiny.glob("*.safetensors"))
    assert 0.9 * on_disk < need < 1.1 * on_disk  # the tiny checkpoint is float32 already
    assert resident_bytes(CheckpointReader(tiny, "cpu"), torch.float32, quantize_experts=True) < need
    with pytest.raises(ModelError, match=r"needs .* GiB but only .* GiB of system memory is free"):
        load_model(tiny, cfg, "cpu", torch.float32, 64, available_memory=need // 2)
    load_model(tiny, cfg, "cpu", torch.float32, 64, available_memory=need * 2)
    from sparkchat.engine.loader import check_memory

    with pytest.raises(ModelError, match=r"of unified \(CPU and GPU\) memory is free"):  # the DGX Spark
        check_memory(2 << 30, 1 << 30, torch.device("cuda"), unified=True)


def test_the_memory_check_counts_the_conversations_caches(tiny):
    """A conversation's caches grow with max_context: counted before any weight moves, to the byte of what
    the state and the rotary tables allocate, and a context that cannot fit is refused by name."""
    from sparkchat.engine.checkpoint import CheckpointReader
    from sparkchat.engine.loader import context_bytes, resident_bytes

    cfg = ModelConfig.from_dir(tiny)
    for dtype in (torch.float32, torch.bfloat16):
        for has_mtp in (True, False):
            c = ModelConfig.from_dir(tiny)
            if not has_mtp:
                c.num_nextn_predict_layers = 0
            state = ConversationState.allocate(c, 96, "cpu", dtype)
            tensors = [state.hidden, *(s.conv for s in state.kda.values()), *(s.recurrent for s in state.kda.values()),
                       *(x for m in [*state.mla.values(), *([state.mtp] if state.mtp else [])]
                         for x in (m.latent, m.rope_key))]
            assert ConversationState.bytes_needed(c, 96, dtype) == sum(x.nbytes for x in tensors), (dtype, has_mtp)
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, 96, cfg.rope_scaling)
    assert RotaryEmbedding.table_bytes(cfg.qk_rope_head_dim, 96) == rope.cos.nbytes + rope.sin.nbytes

    weights = resident_bytes(CheckpointReader(tiny, "cpu"), torch.float32, quantize_experts=False)
    huge = 10**9
    with pytest.raises(ModelError, match=r"a 1,000,000,000-token context: .* GiB of it\) .* shorter context"):
        load_model(tiny, cfg, "cpu", torch.float32, huge, available_memory=weights + context_bytes(cfg, huge, torch.float32) - 1)


def test_next_turn_reuses_the_prompt_checkpoint_when_the_answer_was_rewritten(tiny_model_dir):
    """Templates drop earlier reasoning, so the next prompt holds a rewritten answer: the engine goes
    back to its state right after the previous prompt and prefills only from there."""
    from sparkchat.engine.events import SamplingParams, Switches
    from sparkchat.engine.session import Engine

    engine = Engine.load(tiny_model_dir, device="cpu", max_context=512)
    engine.set_switches(Switches(mtp=True, fp8_head=False))
    p1 = engine.tokenizer.encode_chat([{"role": "user", "content": "hello there"}])
    list(engine.generate_ids(p1, SamplingParams(max_tokens=6, ignore_eos=True)))
    rewritten = p1 + [9, 10, 11, 1, 2, 12, 13]  # not what was generated
    turn2 = [e.token_ids for e in engine.generate_ids(rewritten, SamplingParams(max_tokens=10, ignore_eos=True))]
    engine.reset()
    fresh = [e.token_ids for e in engine.generate_ids(rewritten, SamplingParams(max_tokens=10, ignore_eos=True))]
    assert turn2 == fresh
    engine.reset()
    list(engine.generate_ids(p1, SamplingParams(max_tokens=6, ignore_eos=True)))
    last = list(engine.generate_ids(rewritten, SamplingParams(max_tokens=2)))[-1].stats
    assert last.prefilled_tokens == len(rewritten) - len(p1)


def test_fla_prefill_switch_and_warm_up_off_the_gpu(monkeypatch):
    """SPARKCHAT_FLA_PREFILL=0 keeps prompts on the torch form; a CPU never warms fla-core's kernels
    (Engine.load calls warm_up on a GPU only; the check is the function's own)."""
    from sparkchat.engine.kernels.kda_prefill import fla_chunk_kda, warm_up

    monkeypatch.setenv("SPARKCHAT_FLA_PREFILL", "0")
    assert fla_chunk_kda() is None
    monkeypatch.delenv("SPARKCHAT_FLA_PREFILL")
    said: list[str] = []
    assert not warm_up(32, 128, torch.device("cpu"), torch.float32, said.append)
    assert said == []  # nothing to compile: the load names no slow step


def test_install_hands_each_moe_layer_the_norm_after_it(tiny_model_dir, monkeypatch):
    """SPARKCHAT_MOE_ADD_NORM=1: fastpath.install gives every MoE layer the norm after it (the next layer's
    input norm; the last layer the final norm) and has the MTP layer's MoE run its final norm; switched
    off, or without the MoE kernels, none."""
    from sparkchat.engine import fastpath
    from sparkchat.engine.nn.moe import MoE

    cfg = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, cfg, "cpu", torch.bfloat16, 64, quantize_experts=True)
    layers = list(model.layers)
    assert any(isinstance(layer.mlp, MoE) for layer in layers) and model.mtp is not None
    monkeypatch.setenv("SPARKCHAT_MOE_ADD_NORM", "1")
    fastpath.install(model, linears=False, experts=True, head=False)
    for i, layer in enumerate(layers):
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        assert layer.next_norm is (after if isinstance(layer.mlp, MoE) else None), i
    assert model.mtp.fuse_final_norm
    fastpath.install(model, linears=False, experts=False, head=False)  # the kernels off: the reference path
    assert all(layer.next_norm is None for layer in layers) and not model.mtp.fuse_final_norm
    monkeypatch.setenv("SPARKCHAT_MOE_ADD_NORM", "0")
    fastpath.install(model, linears=False, experts=True, head=False)
    assert all(layer.next_norm is None for layer in layers) and not model.mtp.fuse_final_norm


def _prompt_step_verify_draft(model, cfg) -> tuple[torch.Tensor, ...]:
    """A 12-token prompt's logits, then a decode step's, a 3-token verify's and an MTP draft's."""
    from sparkchat.engine.generate import Decoder

    state = ConversationState.allocate(cfg, 64, "cpu", torch.bfloat16)
    dec = Decoder(model, state)
    hidden, logits, _ = dec.forward(list(range(5, 17)))
    dec.commit(list(range(5, 17)))
    _, step, _ = dec.forward([7])
    _, verify, _ = dec.forward([7, 9, 11])
    draft = model.draft(torch.tensor([3]), hidden[-1:], 12, state.mtp)
    return logits, step, verify, draft


def test_a_moe_layer_handing_on_its_normed_output_changes_nothing(tiny_model_dir):
    """The layers' NormedInput hand-over (the MoE does the add and the next norm, here on the reference
    path) gives the very logits and MTP hidden of the usual add+norm at the next layer's start."""
    from sparkchat.engine.nn.moe import MoE

    cfg = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, cfg, "cpu", torch.bfloat16, 64, quantize_experts=True)
    layers = list(model.layers)

    want = _prompt_step_verify_draft(model, cfg)
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, MoE):
            layer.next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
    model.mtp.fuse_final_norm = True
    got = _prompt_step_verify_draft(model, cfg)
    assert any(layer.next_norm is not None for layer in layers)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_leaving_the_shared_expert_to_the_next_norm_changes_nothing(tiny_model_dir):
    """MoE.late_shared_add (SPARKCHAT_SHARED_ADD_LATE): a decode window's MoE output goes on as a
    PendingSum, its shared part added by the next norm's add+norm (here on the reference path); the
    logits, decode step and MTP draft are those of the routed experts adding it themselves, bit for bit."""
    from sparkchat.engine.nn import norm
    from sparkchat.engine.nn.moe import MoE

    cfg = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, cfg, "cpu", torch.bfloat16, 64, quantize_experts=True)
    moes = [m for m in model.modules() if isinstance(m, MoE) and m.shared_experts is not None]
    assert moes
    for m in moes:  # the fast experts' contract, on the reference experts: `add` summed as torch sums it
        m.fast_experts = (lambda ex: lambda x, ids, w, add=None, join=None: (
            ex(x, ids, w) if add is None else ex(x, ids, w) + add))(m.experts)
    handed_on = []
    original = norm.RMSNorm.add_norm

    def counting(self, x, pending):
        handed_on.append(isinstance(pending, norm.PendingSum))
        return original(self, x, pending)

    want = _prompt_step_verify_draft(model, cfg)
    for m in moes:
        m.late_shared_add = True
    norm.RMSNorm.add_norm = counting
    try:
        got = _prompt_step_verify_draft(model, cfg)
    finally:
        norm.RMSNorm.add_norm = original
    assert any(handed_on) and not all(handed_on)  # decode windows hand on a PendingSum, the prompt does not
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_side_streams_view_of_a_split_norm_reads_it_and_keeps_it():
    """SPARKCHAT_SPLIT_MOE_INPUT_NORM: the router's GEMV takes (and writes) the MoE input's SplitNorm;
    the shared expert beside it gets a view whose SplitNorm only reads, and which keeps it (and its sums
    of squares) for as long as the side stream's join holds the view."""
    pytest.importorskip("triton")
    from sparkchat.engine.kernels.fp8_gemv import SplitNorm, take_split_norm
    from sparkchat.engine.nn.moe import _reading_view

    s = torch.randn(1, 8).bfloat16()
    h = torch.empty_like(s)
    assert _reading_view(h) is h  # nothing to split: the tensor itself
    h.split_norm = SplitNorm(s, torch.ones(1, 2), torch.ones(8).bfloat16(), 1e-6)
    view = _reading_view(h)
    assert view is not h and view.data_ptr() == h.data_ptr()
    assert view.split_norm.write is False and h.split_norm.write is True
    assert take_split_norm(view).ssq is h.split_norm.ssq and hasattr(view, "split_norm")  # kept
    assert take_split_norm(h).write and not hasattr(h, "split_norm")  # taken by its writer
    assert take_split_norm(h) is None


def test_split_norm_window_covers_every_verify_window_unless_set(monkeypatch):
    """SPARKCHAT_SPLIT_NORM_WINDOW: the MoE input norm split up to 5 tokens by default (verify windows of
    up to 4 drafts), one-token steps only with 1; RMSNorm.splits asks both it and split_ok."""
    from sparkchat.engine import fastpath
    from sparkchat.engine.nn.norm import RMSNorm

    monkeypatch.delenv("SPARKCHAT_SPLIT_NORM_WINDOW", raising=False)
    assert fastpath.split_norm_window() == 5
    monkeypatch.setenv("SPARKCHAT_SPLIT_NORM_WINDOW", "1")
    assert fastpath.split_norm_window() == 1
    monkeypatch.setenv("SPARKCHAT_SPLIT_NORM_WINDOW", "0")  # off in profile_step's A/B: one token still splits
    assert fastpath.split_norm_window() == 1
    norm = RMSNorm(8)
    norm.split_window = 4
    x4, x5 = torch.zeros(4, 8), torch.zeros(5, 8)
    assert not norm.splits(x4)  # split_ok off
    norm.split_ok = True
    assert norm.splits(x4) and not norm.splits(x5)
