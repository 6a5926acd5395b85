#!/usr/bin/env python3
"""Golden data for the C engine, computed by step_ref.py on EXPORTED (BF16 / dequantised MXFP4) weights.

Usage: make_goldens.py --tiny models/tiny-step --out test/data/golden [--random-seed 7]

Writes (layout documented in test/data/golden/README.md):
  OUT/random-model/          random edge-case checkpoint (real format, 2 shards, vocab 512)
  OUT/random.json            goldens of the random model (prompts given as token ids)
  OUT/tiny-step.json         goldens of the bundled tiny model
  OUT/tokenizer-cases.json   text -> ids cases of models/tiny-step/tokenizer.json
and prints the MTP acceptance of the tiny model on held-out text (--heldout).
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import configs  # noqa: E402
import step_ref as S  # noqa: E402


def f32(x):
    """float32 -> shortest decimal text that round-trips (as a JSON number)."""
    return float("%.9g" % float(x))


def vec(t):
    return [f32(x) for x in t.reshape(-1).tolist()]


@torch.no_grad()
def draft_chain(model, ids):
    """docs/MODEL.md §3.2 proposer semantics after a prefill of `ids` (T tokens).

    x_T = greedy trunk token after the prompt.  Depth k (0-based) runs MTP layer n_layers+k over
    positions p = 0..T-1 (RoPE position p) with tokens (ids + [x_T, d_1, .., d_k])[p + k + 1] and
    g_p = trunk hidden H_p (k = 0) or MTP layer k-1's pre-norm output at p; the draft logits are
    taken at p = T-1 and d_{k+1} = argmax."""
    cfg = model.cfg
    t = len(ids)
    logits, hidden = model.trunk(torch.tensor([ids]))
    x_t = int(logits[0, -1].argmax())
    seq = list(ids) + [x_t]
    g = hidden
    drafts, dlogits = [], []
    pos = torch.arange(t)
    for k in range(cfg.n_mtp):
        toks = torch.tensor([seq[k + 1: k + 1 + t]])
        lg, g = model.mtp_layer(k, toks, g, pos)
        d = int(lg[0, -1].argmax())
        drafts.append(d)
        dlogits.append(lg[0, -1])
        seq.append(d)
    return x_t, drafts, dlogits


@torch.no_grad()
def greedy(model, ids, n):
    seq = list(ids)
    margins = []
    for _ in range(n):
        logits, _ = model.trunk(torch.tensor([seq]))
        top = torch.topk(logits[0, -1], 2)
        margins.append(f32(top.values[0] - top.values[1]))
        seq.append(int(top.indices[0]))
    return seq[len(ids):], margins


@torch.no_grad()
def router_choice(model, ids, pos):
    """Selected experts (sorted by selection score, descending) and routed weights at `pos`."""
    cfg = model.cfg
    out = {}
    h = model.model.embed_tokens(torch.tensor([ids])).float()
    p = torch.arange(len(ids))
    for i, layer in enumerate(model.model.layers[: cfg.n_layers]):
        if cfg.is_moe(i):
            a = layer.input_layernorm(h)
            hh = h + layer.self_attn(a, p)
            b = layer.post_attention_layernorm(hh)[0, pos: pos + 1]
            z = torch.nn.functional.linear(b, layer.moe.gate.weight.float())
            s = torch.sigmoid(z)
            c = s + layer.moe.router_bias
            sel, w = layer.moe.route(b)
            order = torch.argsort(c[0, sel[0]], descending=True)
            out[str(i)] = {"experts": [int(x) for x in sel[0][order]],
                           "weights": [f32(x) for x in w[0][order]]}
        h = layer(h, p)
    return out


@torch.no_grad()
def case(model, name, ids, text=None, n_greedy=64, logit_pos=None, mtp_full_pos=None):
    cfg = model.cfg
    t = len(ids)
    logits, hidden = model.trunk(torch.tensor([ids]))
    logit_pos = sorted(set(logit_pos or [0, 1, t // 2, t - 1]))
    cont, margins = greedy(model, ids, n_greedy)
    x_t, drafts, dlogits = draft_chain(model, ids)
    assert x_t == cont[0]
    c = {"name": name}
    if text is not None:
        c["text"] = text
    c.update({
        "ids": list(ids),
        "logits": [{"pos": p, "values": vec(logits[0, p])} for p in logit_pos],
        "hidden_last": vec(hidden[0, t - 1]),
        "greedy": cont,
        "greedy_margin": margins,
        "router_last": router_choice(model, ids, t - 1),
        "mtp_draft": {"next_token": x_t, "drafts": drafts,
                      "logits": [vec(x) for x in dlogits]},
    })
    if mtp_full_pos:
        seq = list(ids) + cont
        full_logits, full_hidden = model.trunk(torch.tensor([seq]))
        mtp = model.mtp_chain(torch.tensor([seq]), full_hidden)
        c["mtp_full"] = {"seq_len": len(seq), "depths": [
            [{"pos": p, "values": vec(mtp[k][0, p])} for p in mtp_full_pos if p <= len(seq) - k - 2]
            for k in range(len(mtp))]}
    return c


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")


def make_random_model(out_dir, seed):
    """Random edge-case model (configs.random_golden_config, vocab 512), written in the real format."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    cj = configs.random_golden_config()
    cj["text_config"]["vocab_size"] = 512
    cfg = S.StepConfig.from_json(cj)
    torch.manual_seed(seed)
    model = S.StepModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith(("down_proj.weight", "experts_down", "o_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.12)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for layer in model.model.layers:
            if hasattr(layer, "moe"):
                layer.moe.router_bias.copy_((torch.rand(cfg.n_experts, generator=g) - 0.5) * 0.3)
    S.save_checkpoint(model, cj, out_dir, shards=2)
    return cj


def clamp_report(model, ids):
    """How often the SwiGLU clamps bind on a forward of ids (trunk + MTP chain): counts of elements
    with silu(gate) > L and |up| > L over all clamped MLP/expert evaluations, and their total."""
    orig = S.swiglu
    cnt = {"gate": 0, "up": 0, "n": 0}

    def counting(u, w, limit):
        if limit and limit > 0:
            cnt["gate"] += int((torch.nn.functional.silu(u) > limit).sum())
            cnt["up"] += int((w.abs() > limit).sum())
            cnt["n"] += u.numel()
        return orig(u, w, limit)
    S.swiglu = counting
    try:
        with torch.no_grad():
            _, h = model.trunk(torch.tensor([ids]))
            model.mtp_chain(torch.tensor([ids]), h)
        return dict(cnt)
    finally:
        S.swiglu = orig


@torch.no_grad()
def mtp_acceptance(model, tok, heldout_path, n_prompts=24, prompt_len=48, n_gen=48):
    """Greedy speculative-decoding acceptance of the 3 MTP drafts on held-out KJV prompts.

    For each prompt the trunk's greedy continuation G is computed; on S = prompt + G the MTP chain
    runs in full-sequence mode (drafts equal S tokens whenever the previous drafts were accepted,
    so this is exact for greedy verification).  At every generated position p, draft k is accepted
    iff drafts 1..k all equal S[p+2..p+k+1]."""
    text = open(heldout_path).read()
    ids = tok.encode(text).ids
    stride = max(1, (len(ids) - prompt_len) // n_prompts)
    acc = [0, 0, 0]
    total = 0
    for i in range(n_prompts):
        prompt = [0] + ids[i * stride: i * stride + prompt_len]
        cont, _ = greedy(model, prompt, n_gen)
        seq = prompt + cont
        _, hidden = model.trunk(torch.tensor([seq]))
        mtp = model.mtp_chain(torch.tensor([seq]), hidden)
        for p in range(len(prompt) - 1, len(seq) - 4):
            total += 1
            ok = True
            for k in range(3):
                ok = ok and int(mtp[k][0, p].argmax()) == seq[p + k + 2]
                acc[k] += int(ok)
    return [a / total for a in acc], total


@torch.no_grad()
def mtp_teacher_forced(model, tok, heldout_path, seq=256):
    """Top-1 accuracy on held-out text (true tokens as inputs): trunk at p predicts ids[p+1]; MTP
    depth k at p predicts ids[p+k+2]; 'chain' = depths 1..k all correct (acceptance if the trunk
    were always right)."""
    ids = tok.encode(open(heldout_path).read()).ids
    n = len(ids) // seq
    x = torch.tensor(ids[: n * seq]).view(n, seq)
    hit_t = 0
    hit = [0, 0, 0]
    chain = [0, 0, 0]
    tot_t = tot = 0
    for i in range(0, n, 8):
        b = x[i: i + 8]
        logits, hidden = model.trunk(b)
        hit_t += int((logits[:, :-1].argmax(-1) == b[:, 1:]).sum())
        tot_t += b.shape[0] * (seq - 1)
        mtp = model.mtp_chain(b, hidden)
        m = seq - 4
        ok = torch.ones(b.shape[0], m, dtype=torch.bool)
        for k in range(3):
            c = mtp[k][:, :m].argmax(-1) == b[:, k + 2: k + 2 + m]
            hit[k] += int(c.sum())
            ok = ok & c
            chain[k] += int(ok.sum())
        tot += b.shape[0] * m
    return hit_t / tot_t, [h / tot for h in hit], [c / tot for c in chain]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--random-seed", type=int, default=7)
    ap.add_argument("--heldout", default="")
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.out, exist_ok=True)

    # ---- random edge-case model ----
    rdir = os.path.join(args.out, "random-model")
    make_random_model(rdir, args.random_seed)
    cj, rmodel = S.load_checkpoint(rdir)
    g = torch.Generator().manual_seed(args.random_seed + 1)
    r_prompts = [
        ("short", [0] + torch.randint(10, 512, (6,), generator=g).tolist()),
        ("beyond_window", [0] + torch.randint(10, 512, (47,), generator=g).tolist()),
    ]
    rcases = []
    for name, ids in r_prompts:
        rcases.append(case(rmodel, name, ids, n_greedy=64,
                           mtp_full_pos=[0, 20, 40, 60, 80, 100] if name == "beyond_window" else None,
                           logit_pos=[0, 1, 15, 16, 17, len(ids) - 1] if len(ids) > 20 else None))
    cl = clamp_report(rmodel, r_prompts[1][1] + rcases[1]["greedy"])
    write_json(os.path.join(args.out, "random.json"),
               {"model": "random-model", "cases": rcases, "clamp_bind_counts": cl})
    print("random model clamp binds:", cl)

    if args.skip_tiny:
        return
    # ---- tiny trained model ----
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(args.tiny, "tokenizer.json"))
    cj, model = S.load_checkpoint(args.tiny)
    texts = [
        ("genesis", "In the beginning God created"),
        ("moses", "And the LORD spake unto Moses, saying,"),
        ("long_psalm", "The LORD is my shepherd; I shall not want. He maketh me to lie down in green "
                       "pastures: he leadeth me beside the still waters. He restoreth my soul: he leadeth "
                       "me in the paths of righteousness for his name's sake. Yea, though I walk through "
                       "the valley of the shadow of death, I will fear no evil: for thou art with me; thy "
                       "rod and thy staff they comfort me."),
    ]
    tcases = []
    for name, text in texts:
        ids = [0] + tok.encode(text).ids
        tcases.append(case(model, name, ids, text=text,
                           mtp_full_pos=[0, 10, 40, 63, 64, 65, 100] if name == "long_psalm" else None))
    allseq = tcases[2]["ids"] + tcases[2]["greedy"]
    cl = clamp_report(model, allseq)
    print("tiny model clamp binds (long_psalm + continuation):", cl)
    write_json(os.path.join(args.out, "tiny-step.json"),
               {"model": "models/tiny-step", "cases": tcases, "clamp_bind_counts": cl})
    for c in tcases:
        print(f"[{c['name']}] {tok.decode(c['ids'][1:])!r} -> {tok.decode(c['greedy'])!r}")

    # ---- tokenizer cases ----
    strings = [
        "In the beginning God created the heaven and the earth.",
        "And the LORD said unto Moses, 1234567 times; 3:16!",
        "  leading spaces\n\nnew lines\r\n\ttab  end  ",
        "Unicode: caf\u00e9, na\u00efve, \u4e2d\u6587\u5b57, \u3072\u3089\u304c\u306a, emoji \U0001F600.",
        "<\uff5cbegin\u2581of\u2581sentence\uff5c><|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "Don't won't I'll we've they're O'Neil's",
        "",
    ]
    cases = [{"text": s, "ids": tok.encode(s).ids} for s in strings]
    for c in cases:
        assert tok.decode(c["ids"], skip_special_tokens=False) == c["text"], c
    write_json(os.path.join(args.out, "tokenizer-cases.json"), {"tokenizer": "models/tiny-step/tokenizer.json",
                                                                  "cases": cases})
    if args.heldout:
        rates, n = mtp_acceptance(model, tok, args.heldout)
        print(f"MTP acceptance on held-out ({n} draft positions, greedy): "
              + ", ".join(f"depth {k + 1}: {r * 100:.1f}%" for k, r in enumerate(rates))
              + f"; expected accepted drafts per step {sum(rates):.2f}")
        tr, acc, chain = mtp_teacher_forced(model, tok, args.heldout)
        print(f"held-out teacher-forced top-1: trunk {tr * 100:.1f}%, MTP depth 1/2/3 "
              + " / ".join(f"{a * 100:.1f}%" for a in acc) + "; chained (depths 1..k all right) "
              + " / ".join(f"{a * 100:.1f}%" for a in chain))


if __name__ == "__main__":
    main()
