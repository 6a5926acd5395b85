#!/usr/bin/env python3
"""step_np.py - a numpy port of step_ref.py's inference path (issue 40): the Step-3.5/3.7 text
trunk in FP32, read from a checkpoint in the real format (BF16 upcast exactly, MXFP4 experts
dequantised per docs/MODEL.md §5.3), so the whole-model goldens (text + spliced images) can be
made without torch.

Same semantics as step_ref.StepModel.trunk (docs/MODEL.md §2; tools/reference/README.md
"Reference semantics"): Gemma (1 + w) RMSNorm; q/k RMSNorm per head before RoPE; NeoX RoPE on
the first partial_rotary_factor * head_dim dims (frequencies and angles in float64, cos/sin
rounded to FP32), llama3 scaling for the layer types in yarn_only_types; GQA (query head h reads
KV head h // (heads / kv_heads)); causal attention, sliding layers see the last sliding_window
keys including the current one; head-wise sigmoid gate; SwiGLU silu-then-clamp; FP32 sigmoid
router, bias for selection only, top-k, renormalise, x scaling factor, unweighted shared expert;
final norm, lm_head.  The MTP layers are not ported (the image goldens are trunk logits).

Commands:
  step_np.py check-text MODEL_DIR GOLDEN_JSON [--quick]
      the trunk against step_ref.py's text goldens (test/data/golden/tiny-step.json): logits at
      every golden position, hidden_last, router_last and the greedy continuation (64 tokens;
      --quick: the longest case only, 16 tokens); exit 1 over the tolerance (suite test
      reference-np-text)
  step_np.py image-goldens MODEL_DIR OUT_JSON
      the image goldens (test/data/golden/tiny-step-images.json): 4 synthetic images through
      image_ref.py (views, token layout) and vision_ref.py (the encoder), spliced at the image
      tokens of a chat prompt rendered with the model's template and tokenizer; logits at a few
      positions and 32 greedy tokens.  Needs jinja2 + tokenizers (.venv) and PIL (Debian's
      python3-pil: /usr/lib/python3/dist-packages is appended to sys.path when PIL is missing).
check-text needs numpy only.
"""
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vision_ref  # noqa: E402  (the safetensors reader, the encoder)

F32 = np.float32

# ---- checkpoint ----

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F32)
FP4_VALUES = np.concatenate([FP4, -FP4])


def mxfp4_dequantize(packed, scale):
    """packed U8 [out, in/2], scale U8 [out, in/32] -> FP32 [out, in] (docs/MODEL.md §5.3)"""
    if packed.ndim != 2 or scale.ndim != 2 or packed.shape[0] != scale.shape[0] \
            or packed.shape[1] * 2 != scale.shape[1] * 32:
        raise ValueError("mxfp4: bad shapes packed %s scale %s" % (packed.shape, scale.shape))
    if (scale == 255).any():
        raise ValueError("mxfp4: scale byte 255 (E8M0 NaN) in checkpoint")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    s = np.exp2(scale.astype(F32) - F32(127.0)).repeat(32, axis=1)
    return FP4_VALUES[codes] * s


def read_checkpoint(model_dir):
    """(config.json dict, {name: array}) of the text model's tensors (vision tensors skipped):
    BF16/F32 upcast exactly (float64), U8 as stored"""
    cj = json.load(open(os.path.join(model_dir, "config.json")))
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) \
        else ["model.safetensors"]
    w = {}
    for fn in files:
        for k, a in vision_ref.read_safetensors(os.path.join(model_dir, fn)).items():
            if k.startswith(("vision_model.", "vit_large_projector.")):
                continue
            if k in w:
                raise ValueError("duplicate tensor %s" % k)
            w[k] = a
    return cj, w


class Config:
    """the fields of step_ref.StepConfig the trunk uses (docs/MODEL.md §1.2)"""

    def __init__(self, cj):
        d = cj.get("text_config", cj)
        g = d.get
        self.hidden, self.head_dim = d["hidden_size"], d["head_dim"]
        self.n_layers, self.vocab = d["num_hidden_layers"], d["vocab_size"]
        self.eps = g("rms_norm_eps", 1e-5)
        self.n_kv, self.n_heads_full = d["num_attention_groups"], d["num_attention_heads"]
        other = g("attention_other_setting") or {}
        self.n_heads_sliding = other.get("num_attention_heads", self.n_heads_full)
        self.n_kv_sliding = other.get("num_attention_groups", self.n_kv)
        if other.get("head_dim", self.head_dim) != self.head_dim:
            raise ValueError("sliding head_dim differs from head_dim: unsupported")
        self.window = g("sliding_window")
        self.layer_types = (g("layer_types") or ["full_attention"] * self.n_layers)[: self.n_layers]
        if len(self.layer_types) < self.n_layers:
            raise ValueError("layer_types has fewer than num_hidden_layers entries")
        th = d["rope_theta"]
        self.rope_theta = list(th) if isinstance(th, list) else [th] * self.n_layers
        self.partial = list(g("partial_rotary_factors") or [1.0] * self.n_layers)
        self.rope_scaling = g("rope_scaling")
        self.yarn_only_types = g("yarn_only_types") or []
        moe_enum = g("moe_layers_enum")
        if moe_enum:
            self.moe_layers = {int(x) for x in str(moe_enum).split(",") if x.strip()}
        else:
            self.moe_layers = set(range(self.n_layers)) if g("use_moe") else set()
        self.n_experts, self.top_k = g("moe_num_experts", 0), g("moe_top_k", 0)
        self.norm_expert_weight = g("norm_expert_weight", True)
        self.router_scale = g("moe_router_scaling_factor", 1.0)
        if g("moe_router_activation", "sigmoid") != "sigmoid":
            raise ValueError("only the sigmoid router is supported")
        self.use_router_bias = g("use_moe_router_bias", True)
        n = self.n_layers
        self.swiglu_limits = [float(x or 0.0) for x in (g("swiglu_limits") or [0.0] * n)]
        self.swiglu_limits_shared = [float(x or 0.0) for x in (g("swiglu_limits_shared") or [0.0] * n)]
        for name in ("rope_theta", "partial", "swiglu_limits", "swiglu_limits_shared"):
            if len(getattr(self, name)) < n:
                raise ValueError("%s has fewer than %d entries" % (name, n))

    def is_full(self, layer):
        return self.layer_types[layer] == "full_attention"


def rope_inv_freq(cfg, layer):
    """float64 per-pair frequencies (step_ref.rope_inv_freq)"""
    r = int(cfg.partial[layer] * cfg.head_dim)
    f = float(cfg.rope_theta[layer]) ** (-2.0 * np.arange(r // 2, dtype=np.float64) / r)
    rs = cfg.rope_scaling
    if rs and cfg.layer_types[layer] in cfg.yarn_only_types:
        if rs.get("rope_type", rs.get("type")) != "llama3":
            raise ValueError("only llama3 rope_scaling is supported")
        s, lf, hf = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        l0 = float(rs["original_max_position_embeddings"])
        lam = 2 * math.pi / f
        mu = (l0 / lam - lf) / (hf - lf)
        smooth = (1 - mu) * f / s + mu * f
        f = np.where(lam < l0 / hf, f, np.where(lam > l0 / lf, f / s, smooth))
    return f


def rms_norm(x, w, eps):
    r = F32(1.0) / np.sqrt((x * x).mean(-1, keepdims=True) + F32(eps))
    return x * r * (F32(1.0) + w)


def silu(x):
    return x / (F32(1.0) + np.exp(-x))


def swiglu(u, v, limit):
    a = silu(u)
    if limit > 0:
        a = np.minimum(a, F32(limit))
        v = np.clip(v, F32(-limit), F32(limit))
    return a * v


def softmax(s):
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(-1, keepdims=True)


class Model:
    """The trunk with a KV cache: forward() takes the next positions of one sequence."""

    def __init__(self, model_dir):
        cj, raw = read_checkpoint(model_dir)
        self.cj = cj
        self.cfg = cfg = Config(cj)
        self.w = {k: a.astype(F32) for k, a in raw.items() if a.dtype != np.uint8}
        self.experts = {}
        for l in sorted(cfg.moe_layers):
            for e in range(cfg.n_experts):
                for p in ("gate", "up", "down"):
                    b = "model.layers.%d.moe.experts.%d.%s_proj." % (l, e, p)
                    try:
                        self.experts[l, e, p] = mxfp4_dequantize(raw[b + "weight_packed"], raw[b + "weight_scale"])
                    except KeyError:
                        raise ValueError("missing expert tensor layer %d expert %d %s" % (l, e, p))
        self.inv_freq = [rope_inv_freq(cfg, l) for l in range(cfg.n_layers)]
        self.router_last = {}
        self.reset()

    def reset(self):
        self.pos = 0
        self.kv = [(None, None) for _ in range(self.cfg.n_layers)]

    def embed(self, ids):
        return self.w["model.embed_tokens.weight"][np.asarray(ids)]

    def rope(self, x, pos, layer):
        """x [T, heads, D]: NeoX half-split on the first R dims"""
        f = self.inv_freq[layer]
        r = 2 * len(f)
        if r == 0:
            return x
        ang = pos.astype(np.float64)[:, None] * f[None, :]
        c, s = np.cos(ang).astype(F32)[:, None, :], np.sin(ang).astype(F32)[:, None, :]
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]], axis=-1)

    def attention(self, l, a, pos):
        cfg, w = self.cfg, self.w
        pre = "model.layers.%d.self_attn." % l
        T, d = a.shape[0], cfg.head_dim
        nh = cfg.n_heads_full if cfg.is_full(l) else cfg.n_heads_sliding
        nkv = cfg.n_kv if cfg.is_full(l) else cfg.n_kv_sliding
        q = (a @ w[pre + "q_proj.weight"].T).reshape(T, nh, d)
        k = (a @ w[pre + "k_proj.weight"].T).reshape(T, nkv, d)
        v = (a @ w[pre + "v_proj.weight"].T).reshape(T, nkv, d)
        g = a @ w[pre + "g_proj.weight"].T                                  # [T, nh]
        q = self.rope(rms_norm(q, w[pre + "q_norm.weight"], cfg.eps), pos, l)
        k = self.rope(rms_norm(k, w[pre + "k_norm.weight"], cfg.eps), pos, l)
        K, V = self.kv[l]
        K = k if K is None else np.concatenate([K, k])
        V = v if V is None else np.concatenate([V, v])
        self.kv[l] = (K, V)
        kpos = np.arange(K.shape[0])
        allowed = kpos[None, :] <= pos[:, None]
        if not cfg.is_full(l) and cfg.window:
            allowed &= pos[:, None] - kpos[None, :] < cfg.window
        rep = nh // nkv
        o = np.empty((T, nh, d), dtype=F32)
        scale = F32(1.0 / math.sqrt(d))
        for h in range(nh):
            s = (q[:, h] @ K[:, h // rep].T) * scale
            s = np.where(allowed, s, F32(-np.inf))
            o[:, h] = softmax(s) @ V[:, h // rep]
        o = o * (F32(1.0) / (F32(1.0) + np.exp(-g)))[:, :, None]
        return o.reshape(T, nh * d) @ w[pre + "o_proj.weight"].T

    def mlp(self, pre, x, limit):
        w = self.w
        return swiglu(x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T, limit) \
            @ w[pre + "down_proj.weight"].T

    def moe(self, l, x):
        cfg = self.cfg
        z = x @ self.w["model.layers.%d.moe.gate.weight" % l].T                # FP32 router logits
        s = F32(1.0) / (F32(1.0) + np.exp(-z))
        c = s + self.w["model.layers.%d.moe.router_bias" % l] if cfg.use_router_bias else s
        sel = np.argsort(-c, axis=-1, kind="stable")[:, : cfg.top_k]          # by score, descending
        wt = np.take_along_axis(s, sel, -1)
        if cfg.norm_expert_weight:
            wt = wt / wt.sum(-1, keepdims=True)
        wt = wt * F32(cfg.router_scale)
        self.router_last[l] = (sel[-1].copy(), wt[-1].copy())
        out = np.zeros_like(x)
        limit = cfg.swiglu_limits[l]
        for e in range(cfg.n_experts):
            tok, slot = np.nonzero(sel == e)
            if tok.size == 0:
                continue
            xe = x[tok]
            he = swiglu(xe @ self.experts[l, e, "gate"].T, xe @ self.experts[l, e, "up"].T, limit)
            out[tok] += (he @ self.experts[l, e, "down"].T) * wt[tok, slot][:, None]
        return out

    def forward(self, x):
        """x [T, H] input embeddings of the next T positions -> (logits [T, V], hidden [T, H]
        before the final norm)"""
        cfg, w = self.cfg, self.w
        x = np.asarray(x, dtype=F32)
        pos = np.arange(self.pos, self.pos + x.shape[0])
        h = x
        for l in range(cfg.n_layers):
            pre = "model.layers.%d." % l
            h = h + self.attention(l, rms_norm(h, w[pre + "input_layernorm.weight"], cfg.eps), pos)
            b = rms_norm(h, w[pre + "post_attention_layernorm.weight"], cfg.eps)
            if l in cfg.moe_layers:
                f = self.moe(l, b) + self.mlp(pre + "share_expert.", b, cfg.swiglu_limits_shared[l])
            else:
                f = self.mlp(pre + "mlp.", b, cfg.swiglu_limits_shared[l])
            h = h + f
        self.pos += x.shape[0]
        logits = rms_norm(h, w["model.norm.weight"], cfg.eps) @ w["lm_head.weight"].T
        return logits, h

    def greedy(self, last_logits, n):
        """n greedy tokens after a prefill whose last logits row is last_logits; (tokens,
        top-1 minus top-2 margins)"""
        toks, margins, lg = [], [], last_logits
        for i in range(n):
            t = int(np.argmax(lg))
            top2 = np.partition(lg, -2)[-2:]
            toks.append(t)
            margins.append(float(top2[1] - top2[0]))
            if i + 1 < n:
                lg = self.forward(self.embed([t]))[0][-1]
        return toks, margins


# ---- check-text: against step_ref.py's goldens ----

TOL_TEXT = 1e-4


def check_text(model_dir, golden, quick):
    m = Model(model_dir)
    g = json.load(open(golden))
    cases = g["cases"]
    if quick:
        cases = [max(cases, key=lambda c: len(c["ids"]))]
    worst, ok = 0.0, True
    for c in cases:
        m.reset()
        logits, hidden = m.forward(m.embed(c["ids"]))
        d = max(float(np.abs(logits[r["pos"]] - np.array(r["values"], dtype=np.float64)).max())
                for r in c["logits"])
        dh = float(np.abs(hidden[-1] - np.array(c["hidden_last"])).max())
        dr, same_experts = 0.0, True
        for l, r in c.get("router_last", {}).items():
            sel, wt = m.router_last[int(l)]
            same_experts &= list(sel) == r["experts"]
            dr = max(dr, float(np.abs(wt - np.array(r["weights"])).max()))
        n = 16 if quick else len(c["greedy"])
        toks, _ = m.greedy(logits[-1], n)
        want = c["greedy"][:n]
        same = 0
        while same < n and toks[same] == want[same]:
            same += 1
        good = d <= TOL_TEXT and dh <= TOL_TEXT and dr <= TOL_TEXT and same_experts and same == n
        ok &= good
        worst = max(worst, d)
        print("%s: %d tokens, logits max|d| %.3g at %d positions, hidden_last %.3g, router weights "
              "%.3g (experts %s), greedy %d/%d identical%s"
              % (c["name"], len(c["ids"]), d, len(c["logits"]), dh, dr,
                 "identical" if same_experts else "DIFFER", same, n, "" if good else "  FAIL"))
    print("step_np vs step_ref goldens (%s): max |d logit| %.3g (tolerance %g): %s"
          % (golden, worst, TOL_TEXT, "ok" if ok else "FAIL"))
    return 0 if ok else 1


# ---- image-goldens ----

# the 4 images: (name, width, height, seed); window/crops per image_ref.patch():
#   640x480 (4:3, long <= 728, ratio <= 1.5): the global view only
#   300x420 (portrait 5:7): the global view only
#   1000x620 (long > 728): 504 windows, 2 x 2 crops of the image resized to 1008x1008
#   700x240 (ratio 2.9 > 1.5): 240-pixel windows, 3 x 1 crops of the image resized to 720x240
IMAGES = [("landscape-640x480", 640, 480, 1), ("portrait-300x420", 300, 420, 2),
          ("crops-1000x620", 1000, 620, 3), ("wide-700x240", 700, 240, 4)]
PROMPT_TEXT = "Describe the four pictures."
N_GREEDY = 32


def synth_image(w, h, seed):
    """deterministic uint8 RGB [h, w, 3]: gradients, a disc and a hashed texture (the same
    formula as test/engine/test-image-golden4.c's synth_image)"""
    y, x = np.mgrid[0:h, 0:w].astype(np.int64)
    out = np.empty((h, w, 3), dtype=np.uint8)
    cx, cy, r = w * (seed + 1) // 7, h * (seed + 2) // 9, min(w, h) // 3
    disc = (x - cx) ** 2 + (y - cy) ** 2 < r * r
    for c in range(3):
        hsh = (x * 73 + y * 151 + c * 29 + seed * 97) ^ ((x * y + seed) >> 3)
        v = (x * (c + 1) * 255 // w + y * (3 - c) * 255 // (3 * h) + (hsh & 31) + seed * 50) & 255
        out[..., c] = np.where(disc, 255 - v // 2, v)
    return out


def image_goldens(model_dir, out_path):
    try:
        import PIL  # noqa: F401
    except ImportError:
        sys.path.append("/usr/lib/python3/dist-packages")
    import jinja2
    from PIL import Image
    from tokenizers import Tokenizer
    import image_ref

    m = Model(model_dir)
    cj = m.cj
    tc = json.load(open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8"))
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    vocab = tok.get_vocab()
    ids = {k: vocab["<%s>" % k] for k in ("im_patch", "im_start", "im_end", "patch_start", "patch_end",
                                          "patch_newline")}
    if ids["im_patch"] != cj["image_token_id"]:
        raise ValueError("<im_patch> is %d, config image_token_id %d" % (ids["im_patch"], cj["image_token_id"]))
    msgs = [{"role": "user", "content": [{"type": "image"} for _ in IMAGES] +
             [{"type": "text", "text": PROMPT_TEXT}]}]
    text = jinja2.Environment().from_string(tc["chat_template"]).render(
        messages=msgs, bos_token=tc["bos_token"], add_generation_prompt=True)
    base = tok.encode(text, add_special_tokens=False).ids
    if base.count(ids["im_patch"]) != len(IMAGES):
        raise ValueError("the rendered prompt has %d <im_patch>, want %d" % (base.count(ids["im_patch"]), len(IMAGES)))

    vcfg, vw = vision_ref.load_vision(model_dir)
    prompt, emb, images = [], [], []
    k = 0
    for t in base:
        if t != ids["im_patch"]:
            prompt.append(t)
            continue
        name, w, h, seed = IMAGES[k]
        k += 1
        rgb = synth_image(w, h, seed)
        views, newline, (win, nx, ny) = image_ref.views(Image.fromarray(rgb, "RGB"))
        layout = image_ref.tokens(len(views) - 1, newline, ids)
        at = len(prompt)
        prompt += layout
        rows = []
        for v in views:            # crops row-major, the global view last (token order)
            u8 = np.clip(np.rint(v), 0, 255).astype(np.uint8)
            rows.append(vision_ref.encode_view(vcfg, vw, u8)["proj"])
        view_means = [[float("%.9g" % x) for x in r.mean(0)] for r in rows]
        rows = np.concatenate(rows)
        if rows.shape[0] != layout.count(ids["im_patch"]):
            raise ValueError("%s: %d encoder rows for %d <im_patch>" % (name, rows.shape[0], layout.count(ids["im_patch"])))
        emb.append(rows)
        images.append({"name": name, "width": w, "height": h, "seed": seed, "window": win,
                       "crops_x": nx if win else 0, "crops_y": ny if win else 0,
                       "n_views": len(views), "token_position": at, "n_tokens": len(layout),
                       "rows_max_abs": float(np.abs(rows).max()), "view_mean_rows": view_means})
        print("%s: window %d, %d crops, %d tokens at %d" % (name, win, len(views) - 1, len(layout), at))
    emb = np.concatenate(emb)
    x = m.embed(prompt).copy()
    x[np.array(prompt) == ids["im_patch"]] = emb.astype(F32)     # the splice (docs/ARCHITECTURE.md §5.1)
    m.reset()
    logits, _ = m.forward(x)
    T = len(prompt)
    img_pos = [i["token_position"] for i in images]
    positions = sorted({img_pos[0] + 5, img_pos[2] + 100, img_pos[3] - 1, T - 2, T - 1})
    greedy, margins = m.greedy(logits[-1], N_GREEDY)
    g = {"model": os.path.basename(os.path.normpath(model_dir)),
         "generator": "tools/reference/step_np.py image-goldens",
         "prompt_text": text, "images": images, "ids": prompt, "image_tokens": ids,
         "logits": [{"pos": p, "values": [float("%.9g" % v) for v in logits[p]]} for p in positions],
         "greedy": greedy, "greedy_margin": [float("%.6g" % v) for v in margins]}
    with open(out_path, "w") as f:
        json.dump(g, f, separators=(",", ":"))
        f.write("\n")
    print("%s: %d tokens (%d image rows), logits at %s, greedy %s, min margin %.3g"
          % (out_path, T, emb.shape[0], positions, greedy, min(margins)))


def main():
    a = sys.argv[1:]
    if len(a) in (3, 4) and a[0] == "check-text" and (len(a) == 3 or a[3] == "--quick"):
        sys.exit(check_text(a[1], a[2], len(a) == 4))
    elif len(a) == 3 and a[0] == "image-goldens":
        image_goldens(a[1], a[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
