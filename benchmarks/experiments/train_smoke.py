"""Training smoke: a small causal transformer trained with our attention and with SDPA from the same seed.

    python benchmarks/experiments/train_smoke.py --steps 300 --out benchmarks/experiments/results/train_smoke_h100.jsonl

Task: sequences made of a random 16-token block repeated 16 times (every copy after the first is predictable
by attending 16 positions back, so the loss falls well below log(vocab) only if attention — forward and
backward — works).  Model: 2 layers,
d_model 256, 4 query heads / 2 KV heads of 64 (GQA), bf16 autocast, AdamW.  Prints both loss curves.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dm, hq, hkv, attn):
        super().__init__()
        self.hq, self.hkv, self.dh, self.attn = hq, hkv, dm // hq, attn
        self.ln1, self.ln2 = nn.LayerNorm(dm), nn.LayerNorm(dm)
        self.qkv = nn.Linear(dm, (hq + 2 * hkv) * self.dh, bias=False)
        self.proj = nn.Linear(hq * self.dh, dm, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dm, 4 * dm), nn.GELU(), nn.Linear(4 * dm, dm))

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.hq + 2 * self.hkv, self.dh)
        q, k, v = qkv.split([self.hq, self.hkv, self.hkv], dim=2)
        y = self.attn(q.contiguous(), k.contiguous(), v.contiguous())
        x = x + self.proj(y.reshape(b, s, -1))
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, vocab, dm, layers, hq, hkv, attn):
        super().__init__()
        self.emb = nn.Embedding(vocab, dm)
        self.pos = nn.Parameter(torch.randn(1024, dm) * 0.02)
        self.blocks = nn.ModuleList(Block(dm, hq, hkv, attn) for _ in range(layers))
        self.ln = nn.LayerNorm(dm)
        self.head = nn.Linear(dm, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def sdpa_attn(q, k, v):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def ours_attn(q, k, v):
    import flash_attn_4_sm120 as fa

    return fa.flash_attn_func(q, k, v, causal=True)[0]


def batches(steps, b, vocab, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        block = torch.randint(0, vocab, (b, 16), device="cuda", generator=g)
        yield block.repeat(1, 16)


def train(attn, steps, seed):
    torch.manual_seed(seed)
    vocab = 512
    model = Model(vocab, 256, 2, 4, 2, attn).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step, x in enumerate(batches(steps, 16, vocab, seed)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    ours = train(ours_attn, args.steps, args.seed)
    ref = train(sdpa_attn, args.steps, args.seed)
    rows = []
    for i in range(0, args.steps, 25):
        w = slice(max(0, i - 12), i + 13)
        rows.append(dict(step=i, loss_ours=sum(ours[w]) / len(ours[w]), loss_sdpa=sum(ref[w]) / len(ref[w])))
    tail = 25
    summ = dict(kind="summary", steps=args.steps, device=torch.cuda.get_device_name(),
                initial_loss=math.log(512), final_loss_ours=sum(ours[-tail:]) / tail,
                final_loss_sdpa=sum(ref[-tail:]) / tail)
    summ["final_gap"] = summ["final_loss_ours"] - summ["final_loss_sdpa"]
    print("| step | loss (ours) | loss (SDPA) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['loss_ours']:.3f} | {r['loss_sdpa']:.3f} |")
    print(json.dumps(summ))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows + [summ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
