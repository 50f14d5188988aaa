"""Train the embedded demo model: a tiny Ling-3.0-flash (KDA + gated MLA, dense first layer, MoE with
group-limited routing, expert bias and a shared expert, plus the MTP layer) on Python's own documentation.

    python tools/demo_data.py build/demo/data                                    # data + tokenizer (CPU)
    python tools/train_demo.py train --data build/demo/data --ckpt build/demo/ckpt --minutes 8.5 --device cuda
    python tools/train_demo.py train ... --resume                                # continue a checkpoint
    python tools/train_demo.py export --data build/demo/data --ckpt build/demo/ckpt --out assets/demo
    python tools/train_demo.py eval --model assets/demo --data build/demo/data   # figures for the docs

The main model is transformers' BailingHybridForCausalLM (differentiable, pure-torch chunked KDA). The
MTP layer is built here from transformers' blocks and follows the engine's semantics exactly
(sparkchat/engine/model.py MTPLayer, generate.py): slot p computes
h' = eh_proj([enorm(embed(t[p+1])); hnorm(h[p])]) with h[p] the main model's hidden after model.norm,
then MLA at position p, MoE, final_layernorm, and the main lm_head predicts t[p+2]. Chained drafts feed
the MTP output back as h, so training also runs the layer chained (depth 2 and 3) on its own outputs.
Expert biases follow the aux-loss-free rule: after each step, b += rate * sign(mean load - load).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Spec:
    """The demo model's shape (transformers BailingHybridConfig keyword names)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768  # the dense first layer
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 6
    layer_group_size: int = 3  # layers 2 and 5 are MLA, the rest KDA
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    head_dim: int = 64  # KDA head dim
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    num_local_experts: int = 16
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    pad_token_id: int = 6
    eos_token_id: list[int] = field(default_factory=lambda: [1, 0])

    def check(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} must be a multiple of 32 (MXFP4 groups)")
        if not (1 < self.n_group and self.topk_group < self.n_group):
            raise ValueError("the demo needs group-limited routing: n_group > 1 and topk_group < n_group")


TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 2, "head_dim": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
}

MTP_WEIGHTS = (0.3, 0.15, 0.1)  # loss weight of the MTP layer at chain depth 1, 2, 3


# --- the model ---------------------------------------------------------------------------------


def hf_config(spec: Spec):
    from transformers import BailingHybridConfig

    kw = asdict(spec)
    cfg = BailingHybridConfig(**kw, num_key_value_heads=spec.num_attention_heads, num_mtp_layers=0,
                              norm_topk_prob=True, kda_safe_gate=True, kda_lower_bound=-5.0,
                              short_conv_kernel_size=4, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return cfg


class MTPLayer(nn.Module):
    """The NextN layer, as the engine runs it, from transformers' MLA, MoE and RMSNorm blocks."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
            BailingHybridAttention,
            BailingHybridMoE,
            BailingHybridRMSNorm,
        )

        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = BailingHybridRMSNorm(H, eps), BailingHybridRMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = BailingHybridRMSNorm(H, eps)
        self.attention = BailingHybridAttention(cfg, layer_idx=cfg.num_hidden_layers)
        self.post_attention_layernorm = BailingHybridRMSNorm(H, eps)
        self.mlp = BailingHybridMoE(cfg)
        self.final_layernorm = BailingHybridRMSNorm(H, eps)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """token_embeds: embed(t[p+1]) [B, T, H]; hidden: h[p] [B, T, H] → MTP hidden [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
        a, _ = self.attention(self.input_layernorm(x), position_embeddings, attention_mask=None)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


def build(spec: Spec, seed: int = 0) -> tuple[nn.Module, MTPLayer]:
    from transformers import BailingHybridForCausalLM
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf

    # transformers binds fla-core's GPU kernels for KDA when it is installed: training here needs its torch form
    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        setattr(hf, name, inspect.unwrap(getattr(hf, name)))
    spec.check()
    torch.manual_seed(seed)
    cfg = hf_config(spec)
    model = BailingHybridForCausalLM(cfg)
    mtp = MTPLayer(model.config)
    mtp.apply(model._init_weights)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):  # every norm (layernorm too) starts at 1
                p.fill_(1.0)
    return model.float(), mtp.float()


def routers(model: nn.Module, mtp: MTPLayer) -> list[nn.Module]:
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridTopkRouter

    return [m for m in list(model.modules()) + list(mtp.modules()) if isinstance(m, BailingHybridTopkRouter)]


class BiasBalancer:
    """Aux-loss-free load balancing: count each router's picks, then nudge its expert bias."""

    def __init__(self, rs: list[nn.Module], rate: float) -> None:
        self.routers, self.rate = rs, rate
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in rs]
        self.enabled = True
        for i, r in enumerate(rs):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args, output) -> None:
            if self.enabled and module.training:
                idx = output[2].reshape(-1)
                self.counts[i] += torch.bincount(idx, minlength=module.num_experts).float()
        return hook

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Update every bias; returns the worst max/mean load ratio seen (1.0 = perfectly balanced) as a
        tensor, so that the step does not wait for the GPU (a router that saw no tokens is left alone:
        sign(0 - 0) = 0)."""
        worst = None
        for r, c in zip(self.routers, self.counts):
            mean = c.mean()
            r.e_score_correction_bias += self.rate * torch.sign(mean - c)
            ratio = c.max() / mean.clamp_min(1e-9)
            worst = ratio if worst is None else torch.maximum(worst, ratio)
            c.zero_()
        return worst


def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of w·CE, number of correct argmax predictions weighted by w)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    w = w.flatten()
    correct = (logits.argmax(-1).flatten() == targets.flatten()).float()
    return (ce * w).sum(), (correct * w).sum()


def losses(model: nn.Module, mtp: MTPLayer, ids: torch.Tensor, w: torch.Tensor, depth: int) -> dict[str, Any]:
    """Main next-token loss and the MTP losses at each chain depth, on tokens with weight w > 0.

    ids, w: [B, T]; w[b, i] weighs predicting ids[b, i]. Depth-1 slot p sees the main hidden h[p] and
    t[p+1] and predicts t[p+2]; depth d > 1 sees the depth d-1 output at p-1 instead of h[p].
    """
    B, T = ids.shape
    h = model.model(input_ids=ids).last_hidden_state  # after model.norm
    out: dict[str, Any] = {}
    s, c = weighted_ce(model.lm_head(h[:, :-1]), ids[:, 1:], w[:, 1:])
    n = w[:, 1:].sum().clamp_min(1)
    out["main"], out["main_acc"], out["n"] = s / n, c / n, n
    pos = torch.arange(T - 2, device=ids.device).unsqueeze(0).expand(B, -1)
    pe = model.model.rotary_emb(h, pos)
    emb = model.model.embed_tokens(ids[:, 1:-1])  # t[p+1]
    hin = h[:, :-2]
    total = out["main"]
    for d in range(1, depth + 1):
        m = mtp(emb, hin, pe)
        wd = w[:, 2:].clone()
        wd[:, : d - 1] = 0  # slots before p = d-1 have no chained input
        s, c = weighted_ce(model.lm_head(m), ids[:, 2:], wd)
        nd = wd.sum().clamp_min(1)
        out[f"mtp{d}"], out[f"mtp{d}_acc"] = s / nd, c / nd
        total = total + MTP_WEIGHTS[d - 1] * out[f"mtp{d}"]
        hin = torch.cat([h[:, :1], m[:, :-1]], dim=1)  # slot p gets the output of slot p-1
    out["total"] = total
    return out


# --- data ---------------------------------------------------------------------------------------


class Split:
    """Examples of one split: token ids with the prompt part weighted 0 and the answer part 1."""

    def __init__(self, path: Path) -> None:
        z = np.load(path)
        self.tokens = z["tokens"].astype(np.int64)
        self.index = z["index"]  # (start, prompt_len, length)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def answer_tokens(self) -> int:
        return int((self.index[:, 2] - self.index[:, 1]).sum())

    def rows(self, order: list[int], seq_len: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
        """Pack whole examples, in order, into rows of seq_len (each row starts with an example)."""
        idx = self.index[np.asarray(order, dtype=np.int64)].reshape(-1, 3)
        idx = idx[idx[:, 2] <= seq_len]
        starts, plens, lens = idx[:, 0], idx[:, 1], idx[:, 2]
        row_of = np.empty(len(lens), dtype=np.int64)
        col_of = np.empty(len(lens), dtype=np.int64)
        r, used = 0, 0
        for k, n in enumerate(lens.tolist()):  # greedy, in order: a row ends where the next example won't fit
            if used and used + n > seq_len:
                r, used = r + 1, 0
            row_of[k], col_of[k] = r, used
            used += n
        n_rows = r + 1 if len(lens) else 0
        ids = np.full((n_rows, seq_len), pad, dtype=np.int64)
        wt = np.zeros((n_rows, seq_len), dtype=np.float32)
        ex = np.repeat(np.arange(len(lens)), lens)  # every token's example
        pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # its place in the example
        dst = row_of[ex] * seq_len + col_of[ex] + pos
        ids.reshape(-1)[dst] = self.tokens[starts[ex] + pos]
        wt.reshape(-1)[dst] = (pos >= plens[ex]).astype(np.float32)
        return ids, wt


# --- training -----------------------------------------------------------------------------------


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    t = min((progress - warmup) / (1 - warmup), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, mtp, split: Split, seq_len: int, pad: int, device, batch: int, depth: int,
             most: int = 0) -> dict[str, float]:
    """Losses and accuracies on the answer tokens of split's first `most` examples (0: all of them)."""
    model.eval(), mtp.eval()
    ids_all, w_all = split.rows(list(range(min(len(split), most) if most else len(split))), seq_len, pad)
    sums: dict[str, float] = {}
    count = 0.0
    for b in range(0, len(ids_all), batch):
        ids = torch.from_numpy(ids_all[b:b + batch]).to(device)
        w = torch.from_numpy(w_all[b:b + batch]).to(device)
        out = losses(model, mtp, ids, w, depth)
        n = float(out["n"])
        for k, v in out.items():
            if k not in ("n", "total"):
                sums[k] = sums.get(k, 0.0) + float(v) * n
        count += n
    model.train(), mtp.train()
    res = {k: v / count for k, v in sums.items()}
    res["ppl"] = math.exp(res["main"])
    return res


def _param_groups(model: nn.Module, mtp: MTPLayer, wd: float) -> list[dict[str, Any]]:
    decay, plain = [], []
    for mod in (model, mtp):
        for name, p in mod.named_parameters():
            small = p.ndim < 2 or "norm" in name or "A_log" in name or "dt_bias" in name or "conv1d" in name
            (plain if small else decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


def save_checkpoint(path: Path, spec: Spec, model, mtp, opt, meta: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"spec": asdict(spec), "model": model.state_dict(), "mtp": mtp.state_dict(),
                "opt": opt.state_dict() if opt is not None else None, "meta": meta}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, device: str = "cpu") -> tuple[Spec, nn.Module, MTPLayer, dict[str, Any]]:
    ck = torch.load(path, map_location=device, weights_only=False)
    spec = Spec(**ck["spec"])
    model, mtp = build(spec)
    model.load_state_dict(ck["model"])
    mtp.load_state_dict(ck["mtp"])
    return spec, model.to(device), mtp.to(device), ck


def train(args: argparse.Namespace) -> None:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ckdir = Path(args.ckpt)
    ckdir.mkdir(parents=True, exist_ok=True)
    log = (ckdir / "train.log").open("a")

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")
        log.flush()

    if not args.batch:  # one step takes 48 rows × 1,024 tokens on a GPU (about 72 GB of activations)
        args.batch = 48 if device.type == "cuda" else 4
    data = Path(args.data)
    meta_data = json.loads((data / "meta.json").read_text())
    train_split, valid_split = Split(data / "train.npz"), Split(data / "valid.npz")
    pad = meta_data["special_ids"]["<|pad|>"]
    last = ckdir / "last.pt"
    if args.resume and last.exists():
        spec, model, mtp, ck = load_checkpoint(last, str(device))
        meta = ck["meta"]
        say(f"resumed {last}: step {meta['step']}, {meta['train_s']:.0f} s trained")
    else:
        spec = Spec(vocab_size=meta_data["vocab_size"], **(TINY if args.tiny else {}))
        model, mtp = build(spec, args.seed)
        model, mtp = model.to(device), mtp.to(device)
        ck = None
        meta = {"step": 0, "train_s": 0.0, "tokens": 0, "epoch": 0, "best_valid": None, "seed": args.seed,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    model.train(), mtp.train()
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtp.parameters())
    say(f"device {device} · params {n_params / 1e6:.2f} M · spec {json.dumps(asdict(spec))}")
    say(f"data {data}: {len(train_split)} training examples, {train_split.answer_tokens / 1e6:.2f} M answer "
        f"tokens; batches of {args.batch} rows × {args.seq_len} tokens; validation on "
        f"{min(len(valid_split), args.valid_examples or len(valid_split))} examples every {args.eval_every:.0f} s")
    opt = torch.optim.AdamW(_param_groups(model, mtp, args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=device.type == "cuda")
    if ck is not None and ck.get("opt") is not None:
        opt.load_state_dict(ck["opt"])
    balancer = BiasBalancer(routers(model, mtp), args.bias_rate)
    params = list(model.parameters()) + list(mtp.parameters())
    oom_error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    total_tokens = args.epochs * train_split.answer_tokens
    total_s = (args.total_minutes or args.minutes) * 60
    t_run = time.perf_counter()
    t_log = t_ckpt = t_eval = t_run
    run_s = args.minutes * 60
    done = False
    while not done:
        order = list(range(len(train_split)))
        random.Random(1000 * args.seed + meta["epoch"]).shuffle(order)  # each epoch's order, fixed
        ids_np, w_np = train_split.rows(order, args.seq_len, pad)
        perm = np.random.default_rng(args.seed + meta["epoch"]).permutation(len(ids_np))
        ids_np, w_np = ids_np[perm], w_np[perm]
        row_tokens = w_np[:, 1:].sum(1)  # answer tokens each row trains (counted here: no GPU sync per step)
        ids_all = torch.from_numpy(ids_np).to(device)
        w_all = torch.from_numpy(w_np).to(device)
        # a resumed run continues the same epoch order where the last one stopped
        b = meta.get("next_row", 0)
        while b + args.batch <= len(ids_all):
            elapsed = time.perf_counter() - t_run
            progress = max(meta["tokens"] / total_tokens, (meta["train_s"] + elapsed) / total_s)
            if progress >= 1 or elapsed >= run_s or (args.max_steps and meta["step"] >= args.max_steps):
                done = True
                break
            lr = lr_at(progress, args.lr)
            for g in opt.param_groups:
                g["lr"] = lr
            oom = False
            try:
                out = losses(model, mtp, ids_all[b:b + args.batch], w_all[b:b + args.batch], args.mtp_depth)
                opt.zero_grad(set_to_none=True)
                out["total"].backward()
            except oom_error:
                if args.batch <= 1:
                    raise
                oom = True
            if oom:  # outside the except block, so that the failed step's tensors are freed
                out = None
                opt.zero_grad(set_to_none=True)
                for c in balancer.counts:
                    c.zero_()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                args.batch //= 2
                say(f"out of memory at step {meta['step'] + 1}: batches of {args.batch} rows from now on")
                continue
            out = {k: v.detach() for k, v in out.items()}
            gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            imbalance = balancer.step()
            meta["step"] += 1
            meta["next_row"] = b + args.batch
            meta["tokens"] += int(row_tokens[b:b + args.batch].sum())
            meta["batch"] = args.batch
            b += args.batch
            now = time.perf_counter()
            if now - t_log >= args.log_every or meta["step"] <= 2:
                t_log = now
                say(f"step {meta['step']} ep {meta['epoch']} prog {progress:.3f} lr {lr:.2e} "
                    f"loss {float(out['main']):.3f} acc {float(out['main_acc']):.3f} "
                    + " ".join(f"mtp{d} {float(out[f'mtp{d}']):.3f}/{float(out[f'mtp{d}_acc']):.3f}"
                               for d in range(1, args.mtp_depth + 1))
                    + f" gnorm {float(gnorm):.2f} load {max(1.0, float(imbalance or 1.0)):.2f} "
                    f"{meta['tokens'] / 1e6:.1f} M tok {now - t_run:.0f}s")
            if now - t_eval >= args.eval_every:
                t_eval = now
                _eval_and_keep(model, mtp, valid_split, spec, args, device, pad, meta, ckdir, say,
                               meta["train_s"] + now - t_run)
            if now - t_ckpt >= args.ckpt_every:
                t_ckpt = now
                save_checkpoint(last, spec, model, mtp, opt, {**meta, "train_s": meta["train_s"] + now - t_run})
        else:
            meta["epoch"] += 1
            meta["next_row"] = 0
    meta["train_s"] += time.perf_counter() - t_run
    _eval_and_keep(model, mtp, valid_split, spec, args, device, pad, meta, ckdir, say, meta["train_s"])
    save_checkpoint(last, spec, model, mtp, opt, meta)
    say(f"stopped at step {meta['step']}, epoch {meta['epoch']}, {meta['tokens'] / 1e6:.1f} M answer tokens, "
        f"{meta['train_s']:.0f} s; best valid {meta['best_valid']}")


def _eval_and_keep(model, mtp, split, spec, args, device, pad, meta, ckdir, say, train_s) -> None:
    res = evaluate(model, mtp, split, args.seq_len, pad, device, args.batch, args.mtp_depth, args.valid_examples)
    say("valid " + " ".join(f"{k} {v:.3f}" for k, v in res.items()))
    best = meta.get("best_valid")
    if best is None or res["main"] < best["main"]:
        meta["best_valid"] = {**res, "step": meta["step"]}
        save_checkpoint(ckdir / "best.pt", spec, model, mtp, None, {**meta, "train_s": train_s})


# --- export -------------------------------------------------------------------------------------

OFFICIAL_ALIASES = {"num_local_experts": "num_experts", "num_experts_per_token": "num_experts_per_tok",
                    "n_shared_experts": "num_shared_experts", "num_expert_group": "n_group",
                    "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}


def official_config(model: nn.Module, spec: Spec) -> dict[str, Any]:
    """config.json in the release's key names, with the MTP layer declared."""
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        raw = json.loads((Path(tmp) / "config.json").read_text())
    for k in ("linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "qk_head_dim", "rope_parameters",
              "layer_types", "mlp_layer_types", "num_mtp_layers", "transformers_version", "dtype",
              "output_router_logits", "pretraining_tp", "use_cache", "mtp_loss_scaling_factor"):
        raw.pop(k, None)
    for alias, official in OFFICIAL_ALIASES.items():
        if alias in raw:
            raw[official] = raw.pop(alias)
    raw.update(head_dim=spec.head_dim, rope_theta=spec.rope_theta, num_nextn_predict_layers=1,
               architectures=["BailingMoeV3ForCausalLM"], model_type="bailing_hybrid", torch_dtype="bfloat16",
               eos_token_id=list(spec.eos_token_id), pad_token_id=spec.pad_token_id, score_function="sigmoid",
               router_dtype="fp32", rope_interleave=True, q_lora_rank=None)
    return dict(sorted(raw.items()))


def official_tensors(model: nn.Module, mtp: MTPLayer, spec: Spec) -> dict[str, torch.Tensor]:
    """Every weight under the official Ling names: transformers' save_pretrained for the main model, the
    MTP layer as model.layers.{num_hidden_layers}."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    p = f"model.layers.{spec.num_hidden_layers}"
    sd = {k: v.detach().float().cpu() for k, v in mtp.state_dict().items()}
    for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm", "final_layernorm"):
        tensors[f"{p}.{norm}.weight"] = sd[f"{norm}.weight"]
    tensors[f"{p}.eh_proj.weight"] = sd["eh_proj.weight"]
    for name in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "g_proj"):
        tensors[f"{p}.attention.{name}.weight"] = sd[f"attention.{name}.weight"]
    tensors[f"{p}.attention.dense.weight"] = sd["attention.o_proj.weight"]
    tensors[f"{p}.mlp.gate.weight"] = sd["mlp.gate.weight"]
    tensors[f"{p}.mlp.gate.expert_bias"] = sd["mlp.gate.e_score_correction_bias"]
    inter = spec.moe_intermediate_size
    for e in range(spec.num_local_experts):
        gate_up = sd["mlp.experts.gate_up_proj"][e]  # [2I, H]: gate rows, then up rows
        tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = gate_up[:inter].contiguous()
        tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = gate_up[inter:].contiguous()
        tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = sd["mlp.experts.down_proj"][e].contiguous()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"{p}.mlp.shared_experts.{proj}.weight"] = sd[f"mlp.shared_experts.{proj}.weight"]
    return tensors


def export(ckpt: Path, data: Path, out: Path, shard_max_bytes: int = 15_000_000) -> dict[str, Any]:
    """The fp4 release format (FP8 block linears, MXFP4 routed experts, BF16 embedding and head) with the
    tokenizer files: a model directory the engine loads like the real release."""
    import shutil

    from sparkchat.engine.release import save_release_checkpoint

    spec, model, mtp, ck = load_checkpoint(ckpt)
    tensors = official_tensors(model, mtp, spec)
    for name in ("model.word_embeddings.weight", "lm_head.weight"):
        tensors[name] = tensors[name].to(torch.bfloat16)
    tensors = {k: (v.float() if v.dtype != torch.bfloat16 else v) for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    config = save_release_checkpoint(out, tensors, official_config(model, spec), shard_max_bytes=shard_max_bytes)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(data / name, out / name)
    meta = ck["meta"]
    return {"step": meta["step"], "epoch": meta["epoch"], "train_s": round(meta["train_s"]),
            "best_valid": meta.get("best_valid"), "files": sorted(p.name for p in out.iterdir()),
            "bytes": sum(p.stat().st_size for p in out.iterdir()), "quantization": config["quantization_config"]}


def pack(ckpt: Path, out: Path, shard_max_bytes: int = 15_000_000) -> list[str]:
    """A checkpoint's weights as bf16 safetensors shards (small enough to carry), plus spec and meta."""
    from safetensors.torch import save_file

    ck = torch.load(ckpt, map_location="cpu", weights_only=False)
    flat = {f"model.{k}": v for k, v in ck["model"].items()}
    flat.update({f"mtp.{k}": v for k, v in ck["mtp"].items()})
    flat = {k: (v.to(torch.bfloat16) if v.ndim >= 2 and v.dtype == torch.float32 else v).contiguous()
            for k, v in flat.items()}
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in flat.items():
        nb = v.numel() * v.element_size()
        if shards[-1] and size + nb > shard_max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    names = []
    for i, s in enumerate(shards):
        name = f"{ckpt.stem}-weights-{i}.safetensors"
        save_file(s, str(out / name))
        names.append(name)
    (out / f"{ckpt.stem}-meta.json").write_text(json.dumps({"spec": ck["spec"], "meta": ck["meta"],
                                                            "shards": names}, indent=2, default=str))
    return names


def unpack(src: Path, stem: str, dst: Path) -> None:
    """The inverse of pack: a weights-only checkpoint (no optimizer state) from the shards."""
    from safetensors.torch import load_file

    info = json.loads((src / f"{stem}-meta.json").read_text())
    flat: dict[str, torch.Tensor] = {}
    for name in info["shards"]:
        flat.update(load_file(str(src / name)))
    model = {k[len("model."):]: v.float() for k, v in flat.items() if k.startswith("model.")}
    mtp = {k[len("mtp."):]: v.float() for k, v in flat.items() if k.startswith("mtp.")}
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"spec": info["spec"], "model": model, "mtp": mtp, "opt": None, "meta": info["meta"]}, dst)


# --- evaluation through the engine ------------------------------------------------------------


def _names_the_object(record: dict[str, Any], text: str) -> bool | None:
    """Whether an answer's first line (after any thought) names the object the prompt asked about, as the
    training answers do ("`json.dumps(obj, ...)` is a function ..."); None for topics."""
    kind = record.get("kind") or ("topic" if record["key"].startswith("topic:") else
                                  "module" if record["key"].startswith("module:") else "object")
    if kind == "topic":
        return None
    name = record.get("name") or record["key"].split(":", 1)[-1]
    first = text.split("</think>")[-1].strip().split("\n", 1)[0]
    return f"`{name}`" in first or f"`{name}(" in first


def engine_eval(model_dir: Path, data: Path, n_samples: int = 5, n_accept: int = 20,
                max_tokens: int = 160, max_test: int = 0, prompt_source: str = "any") -> dict[str, Any]:
    """Held-out perplexity (the engine's loaded, quantized model; overall and per data source), sample
    answers, how often an answer names the asked object, and the MTP accept length at temperature 0, with
    thinking off and on. prompt_source: take the prompts from "any" source (the file's order: the
    standard library first), only "python" or only third-party "packages"."""
    from sparkchat.engine.events import SamplingParams
    from sparkchat.engine.session import Engine
    from sparkchat.engine.state import ConversationState

    eng = Engine.load(model_dir, device="cpu")
    test = Split(data / "test.npz")
    sources = json.loads((data / "meta.json").read_text()).get("sources", ["python"])
    z = np.load(data / "test.npz")
    src = z["source"] if "source" in z.files else np.zeros(len(test), dtype=np.uint8)
    sums: dict[str, list[float]] = {}
    rows = test.index.tolist()[:max_test] if max_test else test.index.tolist()
    for (start, plen, n), s in zip(rows, src.tolist()):
        ids = test.tokens[start:start + n].tolist()
        state = ConversationState.allocate(eng.config, n + 1, "cpu", torch.float32)
        h, _ = eng.model(torch.tensor(ids), 0, state)
        logits = eng.model.lm_head(h)
        ce = float(F.cross_entropy(logits[plen - 1:n - 1], torch.tensor(ids[plen:n]), reduction="sum"))
        for group in ("all", "python" if sources[s] == "python" else "packages"):
            acc = sums.setdefault(group, [0.0, 0])
            acc[0] += ce
            acc[1] += int(n - plen)
    prompts = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    if prompt_source != "any":
        prompts = [p for p in prompts if (p.get("source", "python") == "python") == (prompt_source == "python")]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    nll, count = sums["all"]
    result: dict[str, Any] = {"test_answer_tokens": count, "test_ppl": math.exp(nll / count),
                              "test_ppl_by_source": {g: {"ppl": math.exp(a / b), "answer_tokens": b}
                                                     for g, (a, b) in sums.items() if g != "all"},
                              "accept_prompts": n_accept, "prompt_source": prompt_source, "max_tokens": max_tokens}
    for thinking in (False, True):
        samples, accepted, steps, gen, stopped = [], 0.0, 0.0, 0, 0
        named, nameable = 0, 0
        for i, p in enumerate(prompts[:max(n_samples, n_accept)]):
            eng.reset()
            ids = eng.tokenizer.encode_chat(p["messages"], enable_thinking=thinking)
            text, stats, finish = "", None, None
            for ev in eng.generate_ids(ids, params):
                text += ev.text
                stats, finish = ev.stats, ev.finish_reason
            if i < n_accept:
                ok = _names_the_object(p, text)
                if ok is not None:
                    named += ok
                    nameable += 1
            if i < n_accept and stats.accept_length_mean:
                # every token after the first comes from a verify step: pool them over all answers
                accepted += stats.generated_tokens - 1
                steps += (stats.generated_tokens - 1) / stats.accept_length_mean
                gen += stats.generated_tokens
                stopped += finish == "stop"
            if i < n_samples:
                samples.append({"prompt": p["messages"][-1]["content"], "answer": text.strip(),
                                "tokens": stats.generated_tokens, "finish": finish,
                                "accept_length": stats.accept_length_mean})
        mode = "thinking" if thinking else "no_thinking"
        result[mode] = {"accept_length_mean": accepted / steps if steps else None, "generated_tokens": gen,
                        "answers_ended_by_the_model": stopped,
                        "answers_naming_the_asked_object": f"{named}/{nameable}", "samples": samples}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train (or --resume) for at most --minutes")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder (last.pt, best.pt, train.log)")
    t.add_argument("--minutes", type=float, default=8.0, help="this run's time budget")
    t.add_argument("--total-minutes", type=float, default=None, help="the schedule's length over all runs")
    t.add_argument("--epochs", type=float, default=20.0, help="the schedule's length in passes over the answers")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--tiny", action="store_true", help="a tiny shape for CPU debugging")
    t.add_argument("--device", default="auto")
    t.add_argument("--batch", "--batch-rows", dest="batch", type=int, default=0,
                   help="rows of --seq-len tokens per step (default: 48 on a GPU, 4 on the CPU); halved by "
                        "itself if a step runs out of GPU memory")
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--bias-rate", type=float, default=2e-3, help="expert-bias step per update")
    t.add_argument("--mtp-depth", type=int, default=3, choices=(1, 2, 3))
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--log-every", type=float, default=10.0, help="seconds")
    t.add_argument("--eval-every", type=float, default=60.0, help="seconds")
    t.add_argument("--valid-examples", type=int, default=512,
                   help="validate on the first N validation examples (0: all), the same ones every time")
    t.add_argument("--ckpt-every", type=float, default=120.0, help="seconds")
    e = sub.add_parser("export", help="write the release-format model directory")
    e.add_argument("--ckpt", type=Path, required=True, help="a checkpoint file, or a folder holding best.pt")
    e.add_argument("--data", type=Path, required=True)
    e.add_argument("--out", type=Path, default=ROOT / "assets" / "demo")
    p = sub.add_parser("pack", help="a checkpoint as bf16 shards of at most 15 MB")
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack", help="shards from pack back into a weights-only checkpoint")
    u.add_argument("--src", type=Path, required=True)
    u.add_argument("--stem", default="best")
    u.add_argument("--out", type=Path, required=True)
    v = sub.add_parser("eval", help="held-out perplexity, samples and accept length through the engine")
    v.add_argument("--model", type=Path, default=ROOT / "assets" / "demo")
    v.add_argument("--data", type=Path, required=True)
    v.add_argument("--samples", type=int, default=5)
    v.add_argument("--accept-prompts", type=int, default=20)
    v.add_argument("--max-test", type=int, default=0, help="perplexity on the first N test examples (0: all)")
    v.add_argument("--prompt-source", choices=("any", "python", "packages"), default="any",
                   help="where the sample and accept-length prompts come from")
    args = ap.parse_args()
    if args.cmd == "train":
        train(args)
    elif args.cmd == "export":
        ck = args.ckpt / "best.pt" if args.ckpt.is_dir() else args.ckpt
        print(json.dumps(export(ck, args.data, args.out), indent=2))
    elif args.cmd == "pack":
        print(pack(args.ckpt, args.out))
    elif args.cmd == "unpack":
        unpack(args.src, args.stem, args.out)
    else:
        print(json.dumps(engine_eval(args.model, args.data, args.samples, args.accept_prompts,
                                     max_test=args.max_test, prompt_source=args.prompt_source), indent=2))


if __name__ == "__main__":
    main()
