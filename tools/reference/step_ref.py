#!/usr/bin/env python3
"""PyTorch reference implementation of the Step-3.5/3.7 text model (docs/MODEL.md §2, §3, §5).

Everything is computed in FP32 (weights stored BF16 / MXFP4 are upcast exactly).  The same module is
used for training (fp32 parameters, routed experts stacked as [E, out, in]) and as the numeric
oracle for the C engine (parameters loaded from a checkpoint in the real format, experts
dequantised per §5.3).

Public API (used by train.py, make_goldens.py, xcheck_transformers.py):
  StepConfig.from_json(path_or_dict)       parse config.json (nested text_config or flat)
  StepModel(cfg)                           nn.Module; parameter names follow the checkpoint
  load_checkpoint(dir) -> (cfg, model)     read config.json + safetensors shards (MXFP4 dequant)
  save_checkpoint(model, cfg_json, dir, shards=2)   export in the real format
  model.trunk(ids) -> (logits, hidden)     hidden = pre-final-norm hidden state (§2.3)
  model.mtp_chain(ids, hidden) -> [logits_k]   DeepSeek-style MTP chain (§3.2), see mtp_chain
  mxfp4_quantize(w) / mxfp4_dequantize(packed, scale)   §5
"""
import json
import math
import os
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# MXFP4 (docs/MODEL.md §5)

FP4_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
FP4_VALUES = torch.cat([FP4_TABLE, -FP4_TABLE])  # code c -> value (code 8 = -0)


def mxfp4_dequantize(packed, scale):
    """packed U8 [out, in/2], scale U8 [out, in/32] -> FP32 [out, in] (§5.3)."""
    packed = packed.to(torch.uint8)
    scale = scale.to(torch.uint8)
    if packed.dim() != 2 or scale.dim() != 2 or packed.shape[0] != scale.shape[0] \
            or packed.shape[1] * 2 != scale.shape[1] * 32:
        raise ValueError(f"mxfp4: bad shapes packed {tuple(packed.shape)} scale {tuple(scale.shape)}")
    if (scale == 255).any():
        raise ValueError("mxfp4: scale byte 255 (E8M0 NaN) in checkpoint")
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)
    vals = FP4_VALUES[codes]
    exp = scale.to(torch.float32) - 127.0
    s = torch.exp2(exp).repeat_interleave(32, dim=1)
    return vals * s


def _fp4_round(x):
    """Round |x|-scaled values to the nearest E2M1 magnitude index (saturating at 6).
    Ties go to the lower magnitude (argmin picks the first)."""
    mag = x.abs().clamp(max=6.0)
    idx = (mag.unsqueeze(-1) - FP4_TABLE).abs().argmin(dim=-1)
    return idx


def mxfp4_quantize(w):
    """FP32/BF16 [out, in] -> (packed U8 [out, in/2], scale U8 [out, in/32]).

    qstream-like: per 32-block try exponents floor(log2(amax/6)) + {-1, 0, +1}, keep the one with the
    lowest squared error (saturation at +-6); blocks with amax < 1e-6 are zeroed (scale byte 127).
    Exponent bytes are clamped to [0, 254]."""
    w = w.detach().to(torch.float32)
    out, k = w.shape
    if k % 32:
        raise ValueError("mxfp4: in-features must be a multiple of 32")
    blocks = w.reshape(out, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    base = torch.floor(torch.log2(torch.clamp(amax, min=1e-30) / 6.0))
    best_err = None
    best_codes = None
    best_exp = None
    for d in (-1.0, 0.0, 1.0):
        e = torch.clamp(base + d, -127.0, 127.0)
        s = torch.exp2(e).unsqueeze(-1)
        idx = _fp4_round(blocks / s)
        q = FP4_TABLE[idx] * torch.sign(blocks)
        err = ((q * s - blocks) ** 2).sum(-1)
        sign = (blocks < 0).long()
        codes = idx | (sign << 3)
        codes = torch.where(idx == 0, torch.zeros_like(codes), codes)  # no -0 codes
        if best_err is None:
            best_err, best_codes, best_exp = err, codes, e
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_codes = torch.where(better.unsqueeze(-1), codes, best_codes)
            best_exp = torch.where(better, e, best_exp)
    zero = amax < 1e-6
    best_codes = torch.where(zero.unsqueeze(-1), torch.zeros_like(best_codes), best_codes)
    best_exp = torch.where(zero, torch.zeros_like(best_exp), best_exp)
    scale = (best_exp + 127.0).clamp(0, 254).to(torch.uint8)
    codes = best_codes.reshape(out, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


# ----------------------------------------------------------------------------------------------
# Configuration


class StepConfig:
    """Text config of Step-3.5/3.7 (docs/MODEL.md §1.2), all per-layer lists expanded."""

    def __init__(self, d):
        self.raw = d
        g = d.get
        self.hidden = d["hidden_size"]
        self.head_dim = d["head_dim"]
        self.n_layers = d["num_hidden_layers"]
        self.n_mtp = g("num_nextn_predict_layers", 0)
        self.n_all = self.n_layers + self.n_mtp
        self.vocab = d["vocab_size"]
        self.eps = g("rms_norm_eps", 1e-5)
        self.inter = d["intermediate_size"]
        self.n_kv = d["num_attention_groups"]
        self.n_heads_full = d["num_attention_heads"]
        other = g("attention_other_setting") or {}
        self.n_heads_sliding = other.get("num_attention_heads", self.n_heads_full)
        self.n_kv_sliding = other.get("num_attention_groups", self.n_kv)
        if other.get("head_dim", self.head_dim) != self.head_dim:
            raise ValueError("sliding head_dim differs from head_dim: unsupported")
        self.window = g("sliding_window")
        lt = g("layer_types") or ["full_attention"] * self.n_all
        if len(lt) < self.n_all:
            raise ValueError(f"layer_types has {len(lt)} entries, need {self.n_all}")
        self.layer_types = lt[: self.n_all]
        th = d["rope_theta"]
        self.rope_theta = list(th) if isinstance(th, list) else [th] * self.n_all
        pr = g("partial_rotary_factors") or [1.0] * self.n_all
        self.partial = list(pr)
        self.rope_scaling = g("rope_scaling")
        self.yarn_only_types = g("yarn_only_types") or []
        moe_enum = g("moe_layers_enum")
        if moe_enum:
            self.moe_layers = {int(x) for x in str(moe_enum).split(",") if x.strip()}
        else:
            self.moe_layers = set(range(self.n_layers)) if g("use_moe") else set()
        self.n_experts = g("moe_num_experts", 0)
        self.top_k = g("moe_top_k", 0)
        self.moe_inter = g("moe_intermediate_size", 0)
        self.shared_inter = g("share_expert_dim", 0)
        self.norm_expert_weight = g("norm_expert_weight", True)
        self.router_scale = g("moe_router_scaling_factor", 1.0)
        if g("moe_router_activation", "sigmoid") != "sigmoid":
            raise ValueError("only sigmoid router supported")
        self.use_router_bias = g("use_moe_router_bias", True)
        self.swiglu_limits = [float(x or 0.0) for x in (g("swiglu_limits") or [0.0] * self.n_all)]
        self.swiglu_limits_shared = [float(x or 0.0)
                                     for x in (g("swiglu_limits_shared") or [0.0] * self.n_all)]
        for name in ("rope_theta", "partial", "swiglu_limits", "swiglu_limits_shared"):
            if len(getattr(self, name)) < self.n_all:
                raise ValueError(f"{name} has fewer than {self.n_all} entries")

    @staticmethod
    def from_json(src):
        d = src
        if isinstance(src, str):
            with open(src) as f:
                d = json.load(f)
        if "text_config" in d:
            d = d["text_config"]
        return StepConfig(d)

    def is_full(self, layer):
        return self.layer_types[layer] == "full_attention"

    def n_heads(self, layer):
        return self.n_heads_full if self.is_full(layer) else self.n_heads_sliding

    def kv_heads(self, layer):
        return self.n_kv if self.is_full(layer) else self.n_kv_sliding

    def rotary_dim(self, layer):
        return int(self.partial[layer] * self.head_dim)

    def is_moe(self, layer):
        return layer < self.n_layers and layer in self.moe_layers


def rope_inv_freq(cfg, layer):
    """Per-pair frequencies f_i (§2.3 step 4), llama3-scaled for layer types in yarn_only_types."""
    r = cfg.rotary_dim(layer)
    theta = float(cfg.rope_theta[layer])
    i = torch.arange(0, r // 2, dtype=torch.float64)
    f = theta ** (-2.0 * i / r)
    rs = cfg.rope_scaling
    if rs and cfg.layer_types[layer] in cfg.yarn_only_types:
        if rs.get("rope_type", rs.get("type")) != "llama3":
            raise ValueError("only llama3 rope_scaling supported")
        s = float(rs["factor"])
        lf = float(rs["low_freq_factor"])
        hf = float(rs["high_freq_factor"])
        l0 = float(rs["original_max_position_embeddings"])
        lam = 2 * math.pi / f
        mu = (l0 / lam - lf) / (hf - lf)
        smooth = (1 - mu) * f / s + mu * f
        f = torch.where(lam < l0 / hf, f, torch.where(lam > l0 / lf, f / s, smooth))
    return f


def apply_rope(x, pos, inv_freq):
    """x [B, H, T, D]; NeoX half-split on the first R = 2*len(inv_freq) dims."""
    r = inv_freq.numel() * 2
    if r == 0:
        return x
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]          # [T, R/2]
    cos = torch.cos(ang).to(x.dtype)
    sin = torch.sin(ang).to(x.dtype)
    x1 = x[..., : r // 2]
    x2 = x[..., r // 2: r]
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    return torch.cat([y1, y2, x[..., r:]], dim=-1)


# ----------------------------------------------------------------------------------------------
# Modules (parameter names mirror checkpoint names)


class RMSNorm(nn.Module):
    """Gemma-style (1 + w) RMSNorm in FP32 (§2.1)."""

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.eps = eps

    def forward(self, x):
        x = x.float()
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * r * (1.0 + self.weight.float())


def swiglu(u, w, limit):
    """§2.4: silu first, upper clamp on the activated gate, two-sided clamp on up."""
    a = F.silu(u)
    if limit and limit > 0:
        a = torch.clamp(a, max=limit)
        w = torch.clamp(w, -limit, limit)
    return a * w


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, limit):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), limit))


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.nh = cfg.n_heads(layer)
        self.nkv = cfg.kv_heads(layer)
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, self.nh * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, cfg.hidden, bias=False)
        self.g_proj = nn.Linear(cfg.hidden, self.nh, bias=False)
        self.q_norm = RMSNorm(d, cfg.eps)
        self.k_norm = RMSNorm(d, cfg.eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg, layer), persistent=False)

    def forward(self, a, pos):
        b, t, _ = a.shape
        d = self.cfg.head_dim
        q = self.q_proj(a).view(b, t, self.nh, d)
        k = self.k_proj(a).view(b, t, self.nkv, d)
        v = self.v_proj(a).view(b, t, self.nkv, d)
        g = self.g_proj(a)                                    # [b, t, nh]
        q = self.q_norm(q).transpose(1, 2)                    # [b, nh, t, d]
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q = apply_rope(q, pos, self.inv_freq)
        k = apply_rope(k, pos, self.inv_freq)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)                   # head h -> kv h // rep
        v = v.repeat_interleave(rep, dim=1)
        tq = pos[:, None]
        tk = pos[None, :]
        allowed = tk <= tq
        if not self.cfg.is_full(self.layer) and self.cfg.window:
            allowed = allowed & (tq - tk < self.cfg.window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0 / math.sqrt(d))
        o = o * torch.sigmoid(g).transpose(1, 2).unsqueeze(-1)
        o = o.transpose(1, 2).reshape(b, t, self.nh * d)
        return self.o_proj(o)


class MoE(nn.Module):
    """Sigmoid router with selection-only bias, top-k, renorm, scaling (§2.5).

    Routed experts are held stacked: experts_gate/up [E, I, H], experts_down [E, H, I]."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        e, i, h = cfg.n_experts, cfg.moe_inter, cfg.hidden
        self.gate = nn.Linear(h, e, bias=False)
        self.register_buffer("router_bias", torch.zeros(e))
        self.experts_gate = nn.Parameter(torch.empty(e, i, h))
        self.experts_up = nn.Parameter(torch.empty(e, i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.last_load = None  # per-expert token counts of the last forward (training balance)

    def route(self, x):
        z = F.linear(x.float(), self.gate.weight.float())     # FP32 router logits
        s = torch.sigmoid(z)
        c = s + self.router_bias if self.cfg.use_router_bias else s
        sel = torch.topk(c, self.cfg.top_k, dim=-1).indices
        w = torch.gather(s, -1, sel)
        if self.cfg.norm_expert_weight:
            w = w / w.sum(-1, keepdim=True)
        w = w * self.cfg.router_scale
        return sel, w

    def forward(self, x, limit):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        sel, w = self.route(x)
        out = torch.zeros_like(x)
        counts = torch.zeros(self.cfg.n_experts)
        for e in range(self.cfg.n_experts):
            hit = sel == e
            tok = hit.any(-1).nonzero(as_tuple=True)[0]
            counts[e] = tok.numel()
            if tok.numel() == 0:
                continue
            we = (w * hit).sum(-1)[tok]
            xe = x[tok]
            he = swiglu(xe @ self.experts_gate[e].t(), xe @ self.experts_up[e].t(), limit)
            out.index_add_(0, tok, (he @ self.experts_down[e].t()) * we[:, None])
        self.last_load = counts
        return out.reshape(shp)


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


class MTPTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.shared_head = SharedHead(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg, layer)
        if cfg.is_moe(layer):
            self.moe = MoE(cfg)
            self.share_expert = MLP(cfg.hidden, cfg.shared_inter)
        else:
            self.mlp = MLP(cfg.hidden, cfg.inter)
        if layer >= cfg.n_layers:  # MTP layer (§3.1)
            self.enorm = RMSNorm(cfg.hidden, cfg.eps)
            self.hnorm = RMSNorm(cfg.hidden, cfg.eps)
            self.eh_proj = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
            self.transformer = MTPTransformer(cfg)

    def forward(self, h, pos):
        a = self.input_layernorm(h)
        h = h + self.self_attn(a, pos)
        b = self.post_attention_layernorm(h)
        cfg = self.cfg
        if cfg.is_moe(self.layer):
            ls = cfg.swiglu_limits_shared[self.layer]
            f = self.moe(b, cfg.swiglu_limits[self.layer]) + self.share_expert(b, ls)
        else:
            f = self.mlp(b, cfg.swiglu_limits_shared[self.layer])
        return h + f


class StepModelInner(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.n_all)])
        self.norm = RMSNorm(cfg.hidden, cfg.eps)


class StepModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = StepModelInner(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    # ---- trunk (§2) ----
    def trunk(self, ids, pos=None):
        """ids [B, T] -> (logits [B, T, V], hidden [B, T, H] before the final norm)."""
        if pos is None:
            pos = torch.arange(ids.shape[1])
        h = self.model.embed_tokens(ids).float()
        for layer in self.model.layers[: self.cfg.n_layers]:
            h = layer(h, pos)
        return self.lm_head(self.model.norm(h)), h

    # ---- MTP (§3) ----
    def mtp_layer(self, k, tok_ids, g, pos):
        """One MTP layer L = n_layers + k over aligned (token, previous hidden) pairs."""
        layer = self.model.layers[self.cfg.n_layers + k]
        e = self.model.embed_tokens(tok_ids).float()
        m = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(g)], dim=-1))
        hp = layer(m, pos)
        head = layer.transformer.shared_head
        return head.output(head.norm(hp)), hp

    def mtp_chain(self, ids, hidden, depth=None):
        """DeepSeek-style chain over a known sequence (docs/MODEL.md §3.2).

        ids [B, N], hidden [B, N, H] = trunk hidden of ids.  MTP layer k (0-based) runs over
        positions p = 0 .. N-k-2 (RoPE position p, causal + window over those positions) with token
        ids[p+k+1] and previous hidden g_p (trunk hidden H_p for k = 0, MTP layer k-1's pre-norm
        output at p otherwise).  Its logits at p predict ids[p+k+2]; at the last position
        p = N-k-2 that token lies beyond the sequence (a real draft).
        Returns [logits_k [B, N-k-1, V] for k in range(depth)]."""
        depth = self.cfg.n_mtp if depth is None else depth
        out = []
        g = hidden
        n = ids.shape[1]
        for k in range(depth):
            ln = n - k - 1
            if ln <= 0:
                break
            pos = torch.arange(ln)
            logits, g = self.mtp_layer(k, ids[:, k + 1: k + 1 + ln], g[:, :ln], pos)
            out.append(logits)
        return out

    @torch.no_grad()
    def generate(self, ids, n_new):
        """Greedy continuation (full recompute each step; fine for tiny models)."""
        seq = list(ids)
        for _ in range(n_new):
            logits, _ = self.trunk(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
        return seq[len(ids):]


# ----------------------------------------------------------------------------------------------
# Checkpoint I/O (real format, docs/MODEL.md §3.3, §4, §5)

EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)_proj\.(weight_packed|weight_scale)$")


def checkpoint_tensors(model):
    """Yield (name, tensor) in the on-disk format: BF16, U8 packed experts, F32 router bias."""
    cfg = model.cfg
    sd = model.state_dict()
    for name, t in sd.items():
        m = re.match(r"^model\.layers\.(\d+)\.moe\.experts_(gate|up|down)$", name)
        if m:
            layer, proj = m.group(1), m.group(2)
            for e in range(cfg.n_experts):
                packed, scale = mxfp4_quantize(t[e])
                base = f"model.layers.{layer}.moe.experts.{e}.{proj}_proj"
                yield base + ".weight_packed", packed
                yield base + ".weight_scale", scale
        elif name.endswith("moe.router_bias"):
            yield name, t.detach().float().contiguous()
        else:
            yield name, t.detach().to(torch.bfloat16).contiguous()


def _shard_key(name):
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def save_checkpoint(model, config_json, out_dir, shards=2):
    """Write config.json, shards model-0000i-of-0000n.safetensors and the index (safetensors lib)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = dict(checkpoint_tensors(model))
    names = sorted(tensors, key=lambda n: (_shard_key(n), n))
    # split by layer: globals + first half of layers in shard 1, the rest (incl. MTP) after
    n_all = model.cfg.n_all
    groups = [[] for _ in range(shards)]
    for n in names:
        li = _shard_key(n)
        idx = 0 if li < 0 else min(shards - 1, (li * shards) // n_all)
        groups[idx].append(n)
    weight_map = {}
    total = 0
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in g}, os.path.join(out_dir, fn))
        os.chmod(os.path.join(out_dir, fn), 0o644)
        for n in g:
            weight_map[n] = fn
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return total


def read_tensors(ckpt_dir):
    from safetensors import safe_open
    idx_path = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            wm = json.load(f)["weight_map"]
        files = sorted(set(wm.values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(os.path.join(ckpt_dir, fn), "pt") as f:
            for k in f.keys():
                if k in out:
                    raise ValueError(f"duplicate tensor {k}")
                out[k] = f.get_tensor(k)
    return out


def load_checkpoint(ckpt_dir):
    """Build a StepModel from a checkpoint directory; experts dequantised (docs/MODEL.md §5.3)."""
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cj = json.load(f)
    cfg = StepConfig.from_json(cj)
    model = StepModel(cfg)
    raw = read_tensors(ckpt_dir)
    sd = {}
    experts = {}
    for k, t in raw.items():
        m = EXPERT_RE.match(k)
        if m:
            experts[(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))] = t
        else:
            sd[k] = t.float()
    for name, p in model.state_dict().items():
        m = re.match(r"^model\.layers\.(\d+)\.moe\.experts_(gate|up|down)$", name)
        if m:
            layer, proj = int(m.group(1)), m.group(2)
            ws = []
            for e in range(cfg.n_experts):
                try:
                    pk = experts.pop((layer, e, proj, "weight_packed"))
                    sc = experts.pop((layer, e, proj, "weight_scale"))
                except KeyError:
                    raise ValueError(f"missing expert tensor layer {layer} expert {e} {proj}")
                ws.append(mxfp4_dequantize(pk, sc))
            sd[name] = torch.stack(ws)
    if experts:
        raise ValueError(f"unexpected expert tensors: {sorted(experts)[:3]}")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing {missing[:5]} unexpected {unexpected[:5]}")
    for name, p in model.state_dict().items():
        if p.shape != sd[name].shape:
            raise ValueError(f"{name}: shape {tuple(sd[name].shape)} != {tuple(p.shape)}")
    model.eval()
    return cj, model


def quantization_config(cfg):
    """compressed-tensors block as qstream writes it (docs/MODEL.md §5.4)."""
    ignore = [
        r"re:.*lm_head$", r"re:.*model\.embed_tokens$",
        r"re:.*model\.layers\.\d+\.self_attn\.q_proj$", r"re:.*model\.layers\.\d+\.self_attn\.k_proj$",
        r"re:.*model\.layers\.\d+\.self_attn\.v_proj$", r"re:.*model\.layers\.\d+\.self_attn\.o_proj$",
        r"re:.*model\.layers\.\d+\.self_attn\.g_proj$",
        r"re:.*model\.layers\.\d+\.mlp\.gate_proj$", r"re:.*model\.layers\.\d+\.mlp\.up_proj$",
        r"re:.*model\.layers\.\d+\.mlp\.down_proj$",
        r"re:.*model\.layers\.\d+\.share_expert\.gate_proj$", r"re:.*model\.layers\.\d+\.share_expert\.up_proj$",
        r"re:.*model\.layers\.\d+\.share_expert\.down_proj$",
        r"re:.*model\.layers\.\d+\.moe\.gate$", r"re:.*model\.layers\.\d+\.eh_proj$",
        r"re:.*model\.layers\.\d+\.transformer\.shared_head\.output$",
    ]
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*\.experts\.\d+\..*",
                            r"re:.*model\.layers\.\d+\.moe\.experts\.\d+\.gate_up_proj$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "actorder": None,
                            "observer": "minmax"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
