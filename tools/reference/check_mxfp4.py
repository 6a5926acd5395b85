#!/usr/bin/env python3
"""Round-trip check of step_ref's MXFP4 quantiser/packer against compressed-tensors and docs/MODEL.md §5.

Usage: check_mxfp4.py [CKPT_DIR]

1. docs/MODEL.md §5.3 worked examples (0xB3/0x7E -> +0.75/-0.75, 0x70/0x81 -> 0/24).
2. For random weights: our (packed, scale) vs compressed-tensors' MXFP4PackedCompressor.compress() given
   the same per-group scales (compressed-tensors has no exponent search of its own; it packs with
   observer-provided scales): bytes compared, then both decompressed by compressed-tensors'
   decompress() and by step_ref.mxfp4_dequantize() - must be identical.
3. If CKPT_DIR is given: every expert tensor of the checkpoint is decompressed by both and compared.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_ref as S  # noqa: E402


def ct_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="float", strategy="group", group_size=32, symmetric=True))


def ct_compressor():
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    return MXFP4PackedCompressor


def ct_dequant(packed, scale):
    out = ct_compressor().decompress({"weight_packed": packed, "weight_scale": scale}, ct_scheme())
    return out["weight"].float()


def main():
    ex = S.mxfp4_dequantize(torch.tensor([[0xB3] * 16, [0x70] * 16], dtype=torch.uint8),
                            torch.tensor([[0x7E], [0x81]], dtype=torch.uint8))
    assert ex[0, 0] == 0.75 and ex[0, 1] == -0.75 and ex[1, 0] == 0 and ex[1, 1] == 24, ex[:, :2]
    print("docs/MODEL.md §5.3 worked examples: ok")

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * torch.exp(torch.randn(256, 16, generator=g)).repeat_interleave(32, 1) * 0.02
    w[3, :32] = 0  # an all-zero block
    packed, scale = S.mxfp4_quantize(w)
    ours = S.mxfp4_dequantize(packed, scale)
    sqnr = 10 * torch.log10((w ** 2).sum() / ((w - ours) ** 2).sum())
    scale_f = torch.exp2(scale.float() - 127)
    ct = ct_compressor().compress({"weight": w, "weight_scale": scale_f}, ct_scheme())
    same_scale = bool(torch.equal(ct["weight_scale"].to(torch.uint8), scale))
    diff_bytes = int((ct["weight_packed"] != packed).sum())
    x = ct["weight_packed"] ^ packed
    only_zero_sign = bool(((x & 0x77) == 0).all()) and bool(
        (((x & 0x08) == 0) | ((packed & 0x07) == 0)).all()) and bool((((x & 0x80) == 0) | ((packed & 0x70) == 0)).all())
    print(f"  packed-byte differences are only the sign bit of zero codes (+0 vs -0): {only_zero_sign}")
    ct_w = ct_dequant(ct["weight_packed"], ct["weight_scale"].to(torch.uint8))
    ct_ours = ct_dequant(packed, scale)
    print(f"random 256x512: SQNR {sqnr:.2f} dB; scale bytes identical to compressed-tensors: {same_scale}; "
          f"packed bytes differing: {diff_bytes} of {packed.numel()} "
          f"(elements whose dequantised value differs: {int((ct_w != ours).sum())}); "
          f"compressed-tensors decompress of OUR bytes == step_ref dequant: {bool(torch.equal(ct_ours, ours))}")
    if len(sys.argv) > 1:
        raw = S.read_tensors(sys.argv[1])
        n = bad = 0
        for k, t in raw.items():
            if k.endswith(".weight_packed"):
                sc = raw[k[: -len("weight_packed")] + "weight_scale"]
                a = S.mxfp4_dequantize(t, sc)
                b = ct_dequant(t, sc)
                n += 1
                bad += int(not torch.equal(a, b))
        print(f"{sys.argv[1]}: {n} expert matrices, compressed-tensors decompress == step_ref dequant "
              f"for {n - bad} of {n}")
        if bad:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
