#!/usr/bin/env python3
"""Train the tiny Step model on the KJV corpus and export it in the real checkpoint format.

Usage:
  train.py --tok DIR --corpus DIR --out models/tiny-step [--minutes 22] [--init-only]

Trunk next-token loss plus DeepSeek-style MTP losses (depth k predicts token t+k+2, weight
--mtp-weight each).  The router selection bias is trained aux-loss-free (DeepSeek-V3: bias += gamma *
sign(mean load - load) per step).  The LR schedule is a function of elapsed wall time, so the run ends
within --minutes; the last --qat-frac of the time fine-tunes with MXFP4 fake-quantised experts
(straight-through), then the model is exported (experts MXFP4, rest BF16).
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import configs  # noqa: E402
import step_ref as S  # noqa: E402


def init_weights(model, seed, random_norms=False):
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    n_res = 2 * cfg.n_all
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 if random_norms else torch.zeros(p.shape))
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts_down")):
            std = 0.02 / math.sqrt(n_res)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in model.named_buffers():
        if name.endswith("router_bias"):
            with torch.no_grad():
                b.copy_((torch.rand(b.shape, generator=g) - 0.5) * 0.1)


def fake_quant_(model, on):
    """Straight-through MXFP4 fake quantisation of routed experts (QAT)."""
    for layer in model.model.layers:
        if hasattr(layer, "moe"):
            layer.moe.fake_quant = on


def expert_weight(moe, name):
    w = getattr(moe, name)
    if not getattr(moe, "fake_quant", False):
        return w
    e, o, i = w.shape
    pk, sc = S.mxfp4_quantize(w.detach().reshape(e * o, i))
    q = S.mxfp4_dequantize(pk, sc).reshape(e, o, i)
    return w + (q - w).detach()


def moe_forward_train(self, x, limit):
    """Same math as step_ref.MoE.forward, with optional fake-quantised experts."""
    shp = x.shape
    x = x.reshape(-1, shp[-1])
    sel, w = self.route(x)
    wg = expert_weight(self, "experts_gate")
    wu = expert_weight(self, "experts_up")
    wd = expert_weight(self, "experts_down")
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
        he = S.swiglu(xe @ wg[e].t(), xe @ wu[e].t(), limit)
        out.index_add_(0, tok, ((he @ wd[e].t()) * we[:, None]).to(out.dtype))
    self.last_load = counts
    return out.reshape(shp)


S.MoE.forward = moe_forward_train


def losses(model, batch, mtp_weight):
    ids = batch[:, :-1]
    logits, hidden = model.trunk(ids)
    lt = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    # MTP depth k: positions p of ids, token ids[p+k+1] (= batch[p+k+1]), target batch[p+k+2]
    mtp = model.mtp_chain(batch, torch.cat([hidden, hidden[:, -1:]], 1), depth=model.cfg.n_mtp)
    lm = []
    n = batch.shape[1]
    for k, lg in enumerate(mtp):
        # lg has positions 0..n-k-2; targets batch[p+k+2] exist for p <= n-k-3
        tgt = batch[:, k + 2:]
        lg = lg[:, : tgt.shape[1]]
        lm.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1)))
    total = lt + mtp_weight * sum(lm)
    return total, lt, lm


def load_ids(tok_dir, path):
    """Tokenise a corpus file of chapters ("Header\n\nverse\n...\n\n"); BOS before each chapter."""
    import re
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    text = open(path).read()
    docs = [d for d in re.split(r"(?m)^(?=[1-3]? ?[A-Z][A-Za-z ]+ \d+\n\n)", text) if d]
    ids = []
    for enc in tok.encode_batch(docs):
        ids.append(0)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long), len(docs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=22.0)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--qat-frac", type=float, default=0.08)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=float, default=7.0)
    ap.add_argument("--limit-shared", type=float, default=16.0)
    ap.add_argument("--init-only", action="store_true")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--state", default="")
    ap.add_argument("--resume", default="",
                    help="continue from a --state file of an earlier run (same config)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    cj = configs.tiny_config(args.limit, args.limit_shared)
    cfg = S.StepConfig.from_json(cj)
    model = S.StepModel(cfg)
    init_weights(model, args.seed, random_norms=args.init_only)
    if args.resume:
        model.load_state_dict(torch.load(args.resume, map_location="cpu"))
        print(f"resumed from {args.resume}", flush=True)

    def export(tag):
        tmp = args.out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        total = S.save_checkpoint(model, cj, tmp, shards=2)
        for fn in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tok, fn), os.path.join(tmp, fn))
        os.makedirs(args.out, exist_ok=True)
        for fn in os.listdir(args.out):
            if fn.endswith(".safetensors") or fn.endswith(".json"):
                os.remove(os.path.join(args.out, fn))
        for fn in os.listdir(tmp):
            shutil.move(os.path.join(tmp, fn), os.path.join(args.out, fn))
            os.chmod(os.path.join(args.out, fn), 0o644)
        os.rmdir(tmp)
        print(f"[{tag}] exported {args.out} ({total / 1e6:.2f} MB tensor data)", flush=True)

    if args.init_only:
        export("init")
        return

    train_ids, ndocs = load_ids(args.tok, os.path.join(args.corpus, "train.txt"))
    held_ids, _ = load_ids(args.tok, os.path.join(args.corpus, "heldout.txt"))
    print(f"train tokens {train_ids.numel()} ({ndocs} chapters), heldout {held_ids.numel()}", flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("norm.weight") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    budget = args.minutes * 60.0
    t0 = time.time()
    step = 0
    gamma = 1e-3
    qat = False
    seq = args.seq + 1
    ema = None
    while True:
        el = time.time() - t0
        frac = el / budget
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        warm = min(1.0, (step + 1) / 60)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for gq in opt.param_groups:
            gq["lr"] = lr
        if not qat and frac >= 1.0 - args.qat_frac:
            qat = True
            fake_quant_(model, True)
            print(f"step {step}: QAT (MXFP4 fake-quant experts) on", flush=True)
        starts = torch.randint(0, train_ids.numel() - seq, (args.batch,))
        batch = torch.stack([train_ids[s: s + seq] for s in starts])
        model.train()
        total, lt, lm = losses(model, batch, args.mtp_weight)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "moe") and layer.moe.last_load is not None:
                    load = layer.moe.last_load
                    layer.moe.router_bias += gamma * torch.sign(load.mean() - load)
        vals = [lt.item()] + [x.item() for x in lm]
        ema = vals if ema is None else [0.95 * a + 0.05 * b for a, b in zip(ema, vals)]
        if step % 25 == 0:
            print(f"step {step} t={el:.0f}s lr={lr:.2e} loss trunk {ema[0]:.3f} mtp "
                  + " ".join(f"{x:.3f}" for x in ema[1:]), flush=True)
        if step % 500 == 0 and step and args.state:
            torch.save(model.state_dict(), args.state)
        step += 1
    el = time.time() - t0
    print(f"trained {step} steps in {el:.0f}s ({step * args.batch * args.seq / el:.0f} tok/s)", flush=True)
    if args.state:
        torch.save(model.state_dict(), args.state)
    # held-out evaluation (trunk + MTP CE), fp32 experts fake-quantised as exported
    model.eval()
    fake_quant_(model, True)
    with torch.no_grad():
        n = (held_ids.numel() - 1) // seq
        b = held_ids[: n * seq].view(n, seq)
        tot = [0.0] * (1 + cfg.n_mtp)
        for i in range(0, n, 8):
            _, lt, lm = losses(model, b[i: i + 8], args.mtp_weight)
            for j, v in enumerate([lt] + lm):
                tot[j] += v.item() * b[i: i + 8].shape[0]
        print("heldout CE trunk %.3f mtp %s" % (tot[0] / n, " ".join("%.3f" % (x / n) for x in tot[1:])),
              flush=True)
        loads = {i: l.moe.last_load.tolist() for i, l in enumerate(model.model.layers) if hasattr(l, "moe")}
        print("expert loads (last batch):", json.dumps(loads), flush=True)
        print("router bias:", {i: [round(x, 3) for x in l.moe.router_bias.tolist()]
                               for i, l in enumerate(model.model.layers) if hasattr(l, "moe")}, flush=True)
    export("trained")


if __name__ == "__main__":
    main()
