#!/usr/bin/env python3
"""Cross-check step_ref.py against transformers' native `step3p7` text model.

Usage: xcheck_transformers.py CKPT_DIR [CKPT_DIR ...]

Loads each checkpoint with step_ref (MXFP4 experts dequantised), copies the identical FP32 weights into
transformers' Step3p7TextModel (+ a separate lm_head), runs both in FP32 (eager attention) on a
sequence longer than the sliding window and prints the max abs logit difference.  The MTP layers are
not compared: the installed transformers drops layers >= num_hidden_layers on load and has no MTP
forward (see README.md).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_ref as S  # noqa: E402


def hf_text_model(cj):
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel
    t = dict(cj["text_config"])
    t.pop("model_type", None)
    t.pop("architectures", None)
    hcfg = Step3p7TextConfig(**t)
    hcfg._attn_implementation = "eager"
    return Step3p7TextModel(hcfg).float().eval(), hcfg


def map_weights(ref):
    """step_ref state dict -> transformers Step3p7TextModel state dict (+ lm_head)."""
    cfg = ref.cfg
    sd = ref.state_dict()
    out = {}
    for k, v in sd.items():
        if not k.startswith("model."):
            continue
        name = k[len("model."):]
        parts = name.split(".")
        if parts[0] == "layers" and int(parts[1]) >= cfg.n_layers:
            continue
        name = name.replace(".moe.gate.weight", ".mlp.gate.weight")
        name = name.replace(".moe.router_bias", ".mlp.gate.e_score_correction_bias")
        name = name.replace(".share_expert.", ".mlp.shared_experts.")
        if ".moe.experts_" in name:
            continue
        out[name] = v
    for i in range(cfg.n_layers):
        if cfg.is_moe(i):
            moe = ref.model.layers[i].moe
            out[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([moe.experts_gate, moe.experts_up], 1)
            out[f"layers.{i}.mlp.experts.down_proj"] = moe.experts_down
    return out, sd["lm_head.weight"]


@torch.no_grad()
def compare(ckpt, seq_len=None, seed=0):
    cj, ref = S.load_checkpoint(ckpt)
    cfg = ref.cfg
    hf, hcfg = hf_text_model(cj)
    wmap, lm = map_weights(ref)
    missing, unexpected = hf.load_state_dict(wmap, strict=False)
    if missing or unexpected:
        raise SystemExit(f"weight mapping incomplete: missing {missing} unexpected {unexpected}")
    n = seq_len or max(3 * (cfg.window or 64), 160)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(cfg.vocab, 4000), (2, n), generator=g)
    ids[:, 0] = 0
    ref_logits, _ = ref.trunk(ids)
    hf_h = hf(input_ids=ids).last_hidden_state
    hf_logits = hf_h.float() @ lm.t()
    diff = (ref_logits - hf_logits).abs()
    scale = ref_logits.abs().max()
    agree = (ref_logits.argmax(-1) == hf_logits.argmax(-1)).float().mean()
    print(f"{ckpt}: seq {n} (window {cfg.window}): max|logit| {scale:.3f}  max abs diff {diff.max():.3e}  "
          f"mean abs diff {diff.mean():.3e}  argmax agreement {agree * 100:.2f}%")
    return float(diff.max())


@torch.no_grad()
def compare_mtp(ckpt, seq_len=None, seed=1):
    from transformers.modeling_layers import MtpLayer
    from transformers.models.step3p7.modeling_step3p7 import (Step3p7DecoderLayer, Step3p7RMSNorm,
                                                              Step3p7RotaryEmbedding)
    cj, ref = S.load_checkpoint(ckpt)
    cfg = ref.cfg
    _, hcfg = hf_text_model(cj)
    hcfg.mtp_per_layer_config = {k: {"num_attention_heads": cfg.n_heads(cfg.n_layers + k)}
                                 for k in range(cfg.n_mtp)}
    mcfg = hcfg.get_mtp_config()
    mcfg._attn_implementation = "eager"
    # transformers truncates swiglu_limits(_shared) to the trunk layers, so MTP layer k would use trunk
    # layer k's limits; give it the MTP entries (docs/MODEL.md §3.1: swiglu_limits_shared[L]).
    mcfg.swiglu_limits = cfg.swiglu_limits[cfg.n_layers:]
    mcfg.swiglu_limits_shared = cfg.swiglu_limits_shared[cfg.n_layers:]
    rot = Step3p7RotaryEmbedding(mcfg)
    n = seq_len or max(3 * (cfg.window or 64), 160)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, min(cfg.vocab, 4000), (1, n), generator=g)
    ids[:, 0] = 0
    _, hidden = ref.trunk(ids)
    ref_logits = ref.mtp_chain(ids, hidden)
    sd = ref.state_dict()
    worst = 0.0
    gprev = hidden
    for k in range(cfg.n_mtp):
        L = cfg.n_layers + k
        layer = MtpLayer(mcfg, Step3p7DecoderLayer, Step3p7RMSNorm, k, use_post_norm=True).float().eval()
        pre = f"model.layers.{L}."
        w = {}
        for name, v in sd.items():
            if not name.startswith(pre):
                continue
            rest = name[len(pre):]
            if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
                w[rest] = v
            elif rest == "transformer.shared_head.norm.weight":
                w["post_norm.weight"] = v
            elif rest.startswith("transformer.shared_head.output"):
                continue
            else:
                w["mtp_block." + rest] = v
        missing, unexpected = layer.load_state_dict(w, strict=False)
        if missing or unexpected:
            raise SystemExit(f"MTP weight mapping incomplete: missing {missing} unexpected {unexpected}")
        ln = n - k - 1
        pos = torch.arange(ln)[None]
        toks = ids[:, k + 1: k + 1 + ln]
        emb = ref.model.embed_tokens(toks).float()
        ltype = cfg.layer_types[L]
        pe = rot(emb, pos, ltype)
        tq = torch.arange(ln)[:, None]
        tk = torch.arange(ln)[None, :]
        allowed = tk <= tq
        if ltype == "sliding_attention":
            allowed = allowed & (tq - tk < cfg.window)
        mask = torch.zeros(ln, ln).masked_fill(~allowed, float("-inf"))[None, None]
        out = layer(emb, gprev[:, :ln], position_embeddings=pe, attention_mask=mask, position_ids=pos, cache=None)
        hf_logits = out.float() @ sd[pre + "transformer.shared_head.output.weight"].t()
        diff = (hf_logits - ref_logits[k]).abs().max().item()
        worst = max(worst, diff)
        print(f"{ckpt}: MTP depth {k + 1} (layer {L}, {ltype}, {cfg.n_heads(L)} heads): max|logit| "
              f"{ref_logits[k].abs().max():.3f}  max abs diff {diff:.3e}")
        _, gprev = ref.mtp_layer(k, toks, gprev[:, :ln], torch.arange(ln))
    return worst


def main():
    worst = worst_mtp = 0.0
    for d in sys.argv[1:]:
        worst = max(worst, compare(d))
        worst_mtp = max(worst_mtp, compare_mtp(d))
    print(f"worst MTP max abs logit diff: {worst_mtp:.3e}")
    print(f"worst max abs logit diff: {worst:.3e}")


if __name__ == "__main__":
    main()
