#!/usr/bin/env python3
"""numpy reference of the release formats (docs/MODEL.md §5.6 FP8, §5.7 NVFP4, §5.3 MXFP4),
written from the spec alone, checked against the bytes stepd writes (issue 43).

Usage: check_formats.py STEPD_CONVERT TINY_MODEL_DIR

The tiny model (MXFP4) is converted by stepd-mkmodel --from to BF16, FP8 (128 x 128 blocks, experts
stacked [E, out, in]) and NVFP4 (per expert).  This script reads the safetensors files itself
(8-byte header length, JSON header, raw data) and, for every routed expert projection:
  - BF16: the stacked expert equals the original's MXFP4 decode exactly (lossless);
  - FP8: re-quantising that decode here (block amax / 448 in fp32, nearest E4M3 with ties to
    the even code) gives exactly the file's codes and weight_scale_inv;
  - NVFP4: likewise for weight_scale_2 = amax / (6 * 448), the E4M3 group scales and the E2M1
    nibbles (element 2j in the low nibble);
  - each format's decode (numpy, fp64) is within its rounding of the original.
Needs numpy only (no torch): the PyTorch reference (step_ref.py) is not installed here.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e4m3_table():
    """value of each E4M3 byte (fn: bias 7, no inf, 0x7f/0xff NaN)"""
    v = np.empty(256, dtype=np.float64)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        x = (1 + m / 8) * 2.0 ** (e - 7) if e else m * 2.0 ** -9
        v[b] = np.nan if (e == 15 and m == 7) else (-x if b & 0x80 else x)
    return v


E4M3 = e4m3_table()
POS = E4M3[:127]          # codes 0..126, increasing


def e4m3_nearest(x):
    """nearest E4M3 code of fp32 values x (ties to the even code, saturating at 448)"""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    lo = np.clip(np.searchsorted(POS, a, side="right") - 1, 0, 126)
    hi = np.minimum(lo + 1, 126)
    dl, du = a - POS[lo], POS[hi] - a
    up = (du < dl) | ((du == dl) & (lo % 2 == 1) & (hi != lo))
    code = np.where(up, hi, lo).astype(np.uint8)
    return code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)


def e2m1_nearest(a):
    """nearest E2M1 magnitude index of a in [0, 6], ties to the even index"""
    mags = E2M1[:8]
    d = np.abs(a[..., None] - mags)
    best = d.min(axis=-1, keepdims=True)
    ties = d == best
    idx = np.where(ties & (np.arange(8) % 2 == 0), np.arange(8), 99).min(axis=-1)
    one = np.argmax(ties, axis=-1)
    return np.where(ties.sum(axis=-1) > 1, idx, one).astype(np.uint8)


class Ckpt:
    """every tensor of a model directory (index or single file), read with numpy"""
    DT = {"BF16": np.uint16, "F32": np.float32, "U8": np.uint8, "F8_E4M3": np.uint8}

    def __init__(self, d):
        idx = os.path.join(d, "model.safetensors.index.json")
        files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
        self.t = {}
        for f in files:
            raw = open(os.path.join(d, f), "rb").read()
            n = struct.unpack("<Q", raw[:8])[0]
            hdr = json.loads(raw[8:8 + n])
            for k, v in hdr.items():
                if k == "__metadata__":
                    continue
                a, b = v["data_offsets"]
                arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=self.DT[v["dtype"]]).reshape(v["shape"])
                name = k.replace("model.language_model.", "model.")
                self.t[name] = (v["dtype"], arr)

    def get(self, name):
        return self.t[name]


def bf16(u):
    return (u.astype(np.uint32) << 16).view(np.float32)


def mxfp4_decode(packed, scale):
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes] * np.ldexp(1.0, scale.astype(np.int64) - 127).repeat(32, axis=1)


def main():
    conv, tiny = sys.argv[1], sys.argv[2]
    src = Ckpt(tiny)
    cfg = json.load(open(os.path.join(tiny, "config.json")))
    tc = cfg.get("text_config", cfg)
    n_exp = tc["moe_num_experts"]
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for f in ("bf16", "fp8", "nvfp4"):
            subprocess.run([conv, "--from", tiny, "--out", os.path.join(tmp, f), "--format", f], check=True,
                           stdout=subprocess.DEVNULL)
            out[f] = Ckpt(os.path.join(tmp, f))
        checked = 0
        worst = {"fp8": 0.0, "nvfp4": 0.0}
        for name in sorted(src.t):
            if ".moe.experts." not in name or not name.endswith(".weight_packed"):
                continue
            base = name[:-len(".weight_packed")]
            e = int(base.split(".moe.experts.")[1].split(".")[0])
            proj = base.rsplit(".", 1)[1]
            layer = base.split(".moe.experts.")[0]
            w = mxfp4_decode(src.get(name)[1], src.get(base + ".weight_scale")[1])
            w32 = w.astype(np.float32)
            assert np.array_equal(w32.astype(np.float64), w), base
            # BF16, stacked: lossless
            dt, st = out["bf16"].get(f"{layer}.moe.{proj}.weight")
            assert dt == "BF16" and st.shape[0] == n_exp, (base, st.shape)
            assert np.array_equal(bf16(st[e]).astype(np.float64), w), f"bf16 {base}"
            # FP8, stacked, 128 x 128 blocks
            dt, codes = out["fp8"].get(f"{layer}.moe.{proj}.weight")
            _, sinv = out["fp8"].get(f"{layer}.moe.{proj}.weight_scale_inv")
            assert dt == "F8_E4M3" and codes.shape[0] == n_exp
            codes, sinv = codes[e], sinv[e]
            r, c = w.shape
            blk = np.abs(w32).reshape(r // 128, 128, c // 128, 128).max(axis=(1, 3))
            s = np.where(blk > 0, blk / np.float32(448.0), np.float32(1.0)).astype(np.float32)
            assert np.array_equal(s, sinv), f"fp8 scale {base}"
            sfull = s.repeat(128, axis=0).repeat(128, axis=1)
            assert np.array_equal(e4m3_nearest((w32 / sfull).astype(np.float32)), codes), f"fp8 codes {base}"
            dec = E4M3[codes] * sfull.astype(np.float64)
            assert np.all(np.abs(dec - w) <= np.abs(w) / 16 + sfull * 2.0 ** -10), f"fp8 decode {base}"
            worst["fp8"] = max(worst["fp8"], float(np.abs(dec - w).max()))
            # NVFP4, per expert
            _, packed = out["nvfp4"].get(base + ".weight")
            dt, gsc = out["nvfp4"].get(base + ".weight_scale")
            _, g2 = out["nvfp4"].get(base + ".weight_scale_2")
            assert dt == "F8_E4M3" and g2.shape == ()
            amax = np.float32(np.abs(w32).max())
            g = np.float32(amax / np.float32(6.0 * 448.0)) if amax > 0 else np.float32(1.0)
            assert g == g2, f"nvfp4 global scale {base}: {g} vs {g2}"
            gam = np.abs(w32).reshape(r, c // 16, 16).max(axis=2)
            want_sc = e4m3_nearest((gam / np.float32(6.0) / g).astype(np.float32))
            assert np.array_equal(want_sc, gsc), f"nvfp4 scales {base}"
            eff = (E4M3[gsc].astype(np.float32) * g).astype(np.float32).repeat(16, axis=1)
            mag = np.where(eff > 0, np.minimum(np.abs(w32) / np.where(eff > 0, eff, 1), np.float32(6.0)), 0)
            nib = e2m1_nearest(mag.astype(np.float32).astype(np.float64))
            nib = np.where(eff > 0, nib | np.where(w32 < 0, 8, 0), 0).astype(np.uint8)
            want_packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
            assert np.array_equal(want_packed, packed), f"nvfp4 nibbles {base}"
            codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(r, c)
            dec = E2M1[codes] * E4M3[gsc].repeat(16, axis=1) * float(g2)
            worst["nvfp4"] = max(worst["nvfp4"], float(np.abs(dec - w).max()))
            checked += 1
        moe_layers = {k.split(".moe.experts.")[0] for k in src.t if ".moe.experts." in k}
        assert checked == 3 * n_exp * len(moe_layers) and checked > 0, checked
        print(f"check_formats: {checked} expert projections: BF16 exact, FP8 and NVFP4 bytes as the numpy "
              f"reference writes them; worst |decode - original| FP8 {worst['fp8']:.3g}, NVFP4 {worst['nvfp4']:.3g}")


if __name__ == "__main__":
    main()
