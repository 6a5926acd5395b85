#!/usr/bin/env python3
"""numpy reference of the Step-3.7-Flash vision encoder (issue 40), written from the public
modeling code (vLLM step3p7.py's PerceptionEncoder, which loads the original checkpoint names;
transformers' modeling_step3p7.py for the same math) - see docs/ARCHITECTURE.md "Vision encoder".

Per view (uint8 RGB, H = W = a multiple of 4 * patch):
  x = (v / 255 - mean) / std                                 CLIP mean/std (Step3VisionProcessor)
  p = conv1(x) (patch x patch, stride patch, no bias) + pos    pos = positional_embedding, bilinear
                                                                (align_corners=False) to the grid
  h = ln_pre(p); 47 x  h += ls_1 * attn(ln_1(h)); h += ls_2 * fc2(quick_gelu(fc1(ln_2(h))))
      attn: fused in_proj (q, k, v row blocks), 2-D RoPE on q, k (pairs (2j, 2j+1); pairs
      j < D/4 turn by column * f_j, the others by row * f_(j - D/4), f_i = 10000^(-4i/D)),
      bidirectional softmax(q k^T / sqrt(D)) v, out_proj
  d1 = vit_downsampler1(h as [C, g, g]) (3x3, stride 2, pad 1), d2 = vit_downsampler2(d1)
  e = d2 (row-major tokens) . vit_large_projector^T   (no bias)
float64 throughout; BF16 weights upcast exactly.  LayerNorm eps 1e-5.

Commands:
  vision_ref.py make-tower MODEL_DIR     add the tiny vision tower (model-vision.safetensors,
                                         index entries, vision_config) to the tiny model
  vision_ref.py goldens MODEL_DIR OUT    4 synthetic images -> OUT/views.u8 + per-stage f32
                                         activations + OUT/manifest.json
Needs numpy only.
"""
import json
import os
import struct
import sys

import numpy as np

MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])
LN_EPS = 1e-5
ROPE_THETA = 10000.0

# the tiny tower: same architecture, narrow (config.json vision_config of models/tiny-step)
TINY_VISION = {
    "model_type": "perception_encoder",
    "width": 32, "layers": 3, "heads": 2, "patch_size": 14, "image_size": 728,
    "mlp_ratio": 2.5, "hidden_act": "quick_gelu", "ls_init_value": 0.1,
    "use_abs_posemb": True, "use_cls_token": False, "use_rope2d": True,
    "use_ln_pre": True, "use_ln_post": False, "output_dim": None,
}
STAGES = ["patch_embed", "block0", "vit", "ds1", "ds2", "proj"]


# ---- safetensors (8-byte header length, JSON header, raw data) ----

def bf16_bits(a):
    """float -> BF16 bits, round to nearest even"""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = data[b:e]
        if t["dtype"] == "BF16":
            out[name] = bf16_to_f64(np.frombuffer(raw, dtype=np.uint16)).reshape(t["shape"])
        elif t["dtype"] == "F32":
            out[name] = np.frombuffer(raw, dtype=np.float32).astype(np.float64).reshape(t["shape"])
        elif t["dtype"] == "U8":        # MXFP4 packed bytes and scales (step_np.py)
            out[name] = np.frombuffer(raw, dtype=np.uint8).reshape(t["shape"])
        else:
            raise ValueError("%s: %s: dtype %s unsupported" % (path, name, t["dtype"]))
    return out


def write_safetensors(path, tensors):
    """tensors: {name: BF16 bits (uint16 array)}; names sorted, data 8-aligned"""
    hdr, off, blobs = {}, 0, []
    for name in sorted(tensors):
        b = np.ascontiguousarray(tensors[name]).tobytes()
        hdr[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def load_vision(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    idx = json.load(open(os.path.join(model_dir, "model.safetensors.index.json")))["weight_map"]
    files = sorted({f for n, f in idx.items() if n.startswith(("vision_model.", "vit_large_projector."))})
    w = {}
    for f in files:
        for n, t in read_safetensors(os.path.join(model_dir, f)).items():
            if n.startswith(("vision_model.", "vit_large_projector.")):
                w[n] = t
    return cfg, w


# ---- the tower ----

def layer_norm(x, g, b):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + LN_EPS) * g + b


def quick_gelu(x):
    return x / (1.0 + np.exp(-1.702 * x))


def bilinear(pos, g0, g):
    """[g0*g0, C] grid -> [g*g, C], PyTorch bilinear, align_corners=False"""
    if g == g0:
        return pos
    src = pos.reshape(g0, g0, -1)

    def axis(n_out, n_in):
        s = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
        s = np.maximum(s, 0.0)
        i0 = np.floor(s).astype(int)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, s - i0

    y0, y1, ly = axis(g, g0)
    x0, x1, lx = axis(g, g0)
    top = src[y0][:, x0] * (1 - lx)[None, :, None] + src[y0][:, x1] * lx[None, :, None]
    bot = src[y1][:, x0] * (1 - lx)[None, :, None] + src[y1][:, x1] * lx[None, :, None]
    return (top * (1 - ly)[:, None, None] + bot * ly[:, None, None]).reshape(g * g, -1)


def rope2d(x, g, head_dim):
    """x [n, heads, D] with n = g*g tokens in row-major (row, col) order"""
    inv = ROPE_THETA ** (-np.arange(0, head_dim // 2, 2)[: head_dim // 4] / (head_dim // 2))
    rows, cols = np.divmod(np.arange(g * g), g)
    ang = np.concatenate([cols[:, None] * inv[None, :], rows[:, None] * inv[None, :]], axis=1)  # [n, D/2]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x1 * c + x0 * s
    return out


def conv_s2(x, w, b):
    """x [C, g, g], w [O, C, 3, 3], stride 2, pad 1 -> [O, g', g']"""
    C, g, _ = x.shape
    go = (g + 2 - 3) // 2 + 1
    xp = np.zeros((C, g + 2, g + 2))
    xp[:, 1:-1, 1:-1] = x
    cols = np.empty((go * go, C, 3, 3))
    for ky in range(3):
        for kx in range(3):
            cols[:, :, ky, kx] = xp[:, ky:ky + 2 * go:2, kx:kx + 2 * go:2].reshape(C, -1).T
    y = cols.reshape(go * go, -1) @ w.reshape(w.shape[0], -1).T + b
    return y.T.reshape(-1, go, go)


def encode_view(cfg, w, view):
    """view uint8 [H, W, 3] -> {stage: array}"""
    vc = cfg["vision_config"]
    P, C, heads = vc["patch_size"], vc["width"], vc["heads"]
    D = C // heads
    H = view.shape[0]
    g = H // P
    g0 = vc["image_size"] // P
    x = (view.astype(np.float64) / 255.0 - MEAN) / STD                     # [H, W, 3]
    patches = x.reshape(g, P, g, P, 3).transpose(0, 2, 4, 1, 3).reshape(g * g, 3 * P * P)
    conv1 = w["vision_model.conv1.weight"].reshape(C, -1)
    h = patches @ conv1.T + bilinear(w["vision_model.positional_embedding"], g0, g)
    st = {"patch_embed": h.copy()}
    h = layer_norm(h, w["vision_model.ln_pre.weight"], w["vision_model.ln_pre.bias"])
    n = g * g
    for l in range(vc["layers"]):
        pre = "vision_model.transformer.resblocks.%d." % l
        a = layer_norm(h, w[pre + "ln_1.weight"], w[pre + "ln_1.bias"])
        qkv = a @ w[pre + "attn.in_proj_weight"].T + w[pre + "attn.in_proj_bias"]
        q, k, v = (qkv[:, i * C:(i + 1) * C].reshape(n, heads, D) for i in range(3))
        q, k = rope2d(q, g, D), rope2d(k, g, D)
        o = np.empty((n, heads, D))
        for hh in range(heads):
            s = q[:, hh] @ k[:, hh].T / np.sqrt(D)
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh]
        o = o.reshape(n, C) @ w[pre + "attn.out_proj.weight"].T + w[pre + "attn.out_proj.bias"]
        h = h + w[pre + "ls_1.gamma"] * o
        a = layer_norm(h, w[pre + "ln_2.weight"], w[pre + "ln_2.bias"])
        m = quick_gelu(a @ w[pre + "mlp.c_fc.weight"].T + w[pre + "mlp.c_fc.bias"])
        m = m @ w[pre + "mlp.c_proj.weight"].T + w[pre + "mlp.c_proj.bias"]
        h = h + w[pre + "ls_2.gamma"] * m
        if l == 0:
            st["block0"] = h.copy()
    st["vit"] = h.copy()
    d = conv_s2(h.T.reshape(C, g, g), w["vision_model.vit_downsampler1.weight"], w["vision_model.vit_downsampler1.bias"])
    st["ds1"] = d.reshape(d.shape[0], -1).T.copy()
    d = conv_s2(d, w["vision_model.vit_downsampler2.weight"], w["vision_model.vit_downsampler2.bias"])
    t = d.reshape(d.shape[0], -1).T
    st["ds2"] = t.copy()
    st["proj"] = t @ w["vit_large_projector.weight"].T
    return st


# ---- the tiny tower and the goldens ----

def tower_tensors(vc, text_hidden, rng):
    C, L, P = vc["width"], vc["layers"], vc["patch_size"]
    inter = int(C * vc["mlp_ratio"])
    g0 = vc["image_size"] // P

    def rnd(*shape, scale):
        return rng.standard_normal(shape) * scale

    t = {
        "vision_model.conv1.weight": rnd(C, 3, P, P, scale=(3 * P * P) ** -0.5),
        "vision_model.positional_embedding": rnd(g0 * g0, C, scale=C ** -0.5),
        "vision_model.ln_pre.weight": 1 + rnd(C, scale=0.1),
        "vision_model.ln_pre.bias": rnd(C, scale=0.1),
        "vision_model.vit_downsampler1.weight": rnd(2 * C, C, 3, 3, scale=(9 * C) ** -0.5),
        "vision_model.vit_downsampler1.bias": rnd(2 * C, scale=0.02),
        "vision_model.vit_downsampler2.weight": rnd(4 * C, 2 * C, 3, 3, scale=(18 * C) ** -0.5),
        "vision_model.vit_downsampler2.bias": rnd(4 * C, scale=0.02),
        "vit_large_projector.weight": rnd(text_hidden, 4 * C, scale=(4 * C) ** -0.5),
    }
    for l in range(L):
        pre = "vision_model.transformer.resblocks.%d." % l
        t[pre + "attn.in_proj_weight"] = rnd(3 * C, C, scale=C ** -0.5)
        t[pre + "attn.in_proj_bias"] = rnd(3 * C, scale=0.02)
        t[pre + "attn.out_proj.weight"] = rnd(C, C, scale=C ** -0.5)
        t[pre + "attn.out_proj.bias"] = rnd(C, scale=0.02)
        for n in ("ln_1", "ln_2"):
            t[pre + n + ".weight"] = 1 + rnd(C, scale=0.1)
            t[pre + n + ".bias"] = rnd(C, scale=0.1)
        t[pre + "ls_1.gamma"] = vc["ls_init_value"] * (1 + rnd(C, scale=0.5))
        t[pre + "ls_2.gamma"] = vc["ls_init_value"] * (1 + rnd(C, scale=0.5))
        t[pre + "mlp.c_fc.weight"] = rnd(inter, C, scale=C ** -0.5)
        t[pre + "mlp.c_fc.bias"] = rnd(inter, scale=0.02)
        t[pre + "mlp.c_proj.weight"] = rnd(C, inter, scale=inter ** -0.5)
        t[pre + "mlp.c_proj.bias"] = rnd(C, scale=0.02)
    return t


def make_tower(model_dir):
    cfgp = os.path.join(model_dir, "config.json")
    idxp = os.path.join(model_dir, "model.safetensors.index.json")
    cfg = json.load(open(cfgp))
    idx = json.load(open(idxp))
    if "vision_config" in cfg:
        sys.exit("%s already has a vision_config" % cfgp)
    vc = dict(TINY_VISION)
    t = {n: bf16_bits(a) for n, a in tower_tensors(vc, cfg["text_config"]["hidden_size"],
                                                     np.random.default_rng(4040)).items()}
    shard = "model-vision.safetensors"
    write_safetensors(os.path.join(model_dir, shard), t)
    for n in t:
        idx["weight_map"][n] = shard
    idx["weight_map"] = dict(sorted(idx["weight_map"].items()))
    idx["metadata"]["total_size"] += sum(a.nbytes for a in t.values())
    add_image_tokens(model_dir, cfg)
    cfg["vision_config"] = vc
    cfg["projector_bias"] = False
    cfg["understand_projector_stride"] = 2
    json.dump(cfg, open(cfgp, "w"), indent=2, ensure_ascii=False)
    open(cfgp, "a").write("\n")
    json.dump(idx, open(idxp, "w"), indent=2)
    open(idxp, "a").write("\n")
    print("%s: %d tensors, %d bytes" % (shard, len(t), os.path.getsize(os.path.join(model_dir, shard))))


# Step-3.7's image tokens, appended after the tiny vocabulary's 4000 used ids (no text id moves)
IMAGE_TOKENS = ["<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"]
IMAGE_TOKEN_ID0 = 4000


def add_image_tokens(model_dir, cfg):
    """special tokens 4000.. in tokenizer.json / tokenizer_config.json, image_token_id in cfg"""
    tp = os.path.join(model_dir, "tokenizer.json")
    cp = os.path.join(model_dir, "tokenizer_config.json")
    tok = json.load(open(tp, encoding="utf-8"))
    tc = json.load(open(cp, encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    for k, content in enumerate(IMAGE_TOKENS):
        i = IMAGE_TOKEN_ID0 + k
        assert content not in vocab and i not in vocab.values(), content
        vocab[content] = i
        ent = {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True}
        tok["added_tokens"].append(ent)
        tc["added_tokens_decoder"][str(i)] = {k2: ent[k2] for k2 in ("content", "lstrip", "normalized", "rstrip",
                                                                       "single_word", "special")}
    open(tp, "w", encoding="utf-8").write(json.dumps(tok, indent=2, ensure_ascii=False))
    open(cp, "w", encoding="utf-8").write(json.dumps(tc, indent=2, ensure_ascii=False))
    cfg["image_token_id"] = IMAGE_TOKEN_ID0


def synth_view(seed, size):
    """deterministic uint8 RGB view: gradients + a hashed texture (same formula as the C test)"""
    y, x = np.mgrid[0:size, 0:size].astype(np.int64)
    out = np.empty((size, size, 3), dtype=np.uint8)
    for c in range(3):
        hsh = (x * 73 + y * 151 + c * 29 + seed * 97) ^ ((x * y + seed) >> 3)
        out[..., c] = ((x * (c + 1) + y * (3 - c)) // 4 + (hsh & 63) + seed * 40) & 255
    return out


# 4 images: (seed, [view sizes]) - a global 728 view plus 0..4 local 504 crops
IMAGES = [(1, [728]), (2, [728, 504]), (3, [728, 504, 504]), (4, [728, 504, 504, 504, 504])]


def goldens(model_dir, out):
    cfg, w = load_vision(model_dir)
    os.makedirs(out, exist_ok=True)
    man = {"stages": STAGES, "images": []}
    views = open(os.path.join(out, "views.u8"), "wb")
    for i, (seed, sizes) in enumerate(IMAGES):
        img = {"views": []}
        for j, size in enumerate(sizes):
            v = synth_view(seed * 10 + j, size)
            views.write(v.tobytes())
            st = encode_view(cfg, w, v)
            rec = {"size": size}
            for s in STAGES:
                fn = "img%d-view%d-%s.f32" % (i, j, s)
                st[s].astype(np.float32).tofile(os.path.join(out, fn))
                rec[s] = {"file": fn, "shape": list(st[s].shape), "max_abs": float(np.abs(st[s]).max())}
            img["views"].append(rec)
        man["images"].append(img)
    views.close()
    json.dump(man, open(os.path.join(out, "manifest.json"), "w"), indent=1)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "make-tower":
        make_tower(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "goldens":
        goldens(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
