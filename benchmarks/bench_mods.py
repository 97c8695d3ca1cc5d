"""Mods benchmark (issue 9's targets): flex-style masks written as a block mask plus a mask_mod, against the
built-in path that computes the same attention, forward and backward, one process.

    python benchmarks/bench_mods.py --out benchmarks/results/mods_h100.jsonl

Cases (bf16, d128, 16 heads, B*S = 16K tokens):
  causal     causal=True  vs  diagonal (128, 128) blocks as "mask" blocks + mods.causal(), blocks below as "full"
             (target: within 10%), at S = 4K and 16K
  document   8 packed documents of random lengths (one sequence of 16K tokens): flash_attn_varlen_func on the
             documents  vs  a block mask of the document pairs + mods.document() (target: within 10%)
Timed regions as bench_block_sparse.py (median of CUDA-event timed calls; the backward is torch.autograd.grad of
a fixed forward graph, our host pieces included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import time_fn  # noqa: E402


def _blocks_causal(s, bs):
    n = -(-s // bs)
    qb = torch.arange(n, device="cuda")[:, None]
    kb = torch.arange(n, device="cuda")[None, :]
    return (qb == kb)[None, None], (kb < qb)[None, None]


def _blocks_document(ids, n, bs):
    nb = -(-n // bs)
    starts = torch.arange(nb, device="cuda") * bs
    ends = torch.clamp(starts + bs, max=n)
    first, last = ids[starts], ids[ends - 1]
    visited = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    full = (first[:, None] == last[:, None]) & (first[None, :] == last[None, :]) & (first[:, None] == first[None, :])
    return (visited & ~full)[None, None], full[None, None]


def document_case(n, h, d, bs, g):
    """The document-mask cell: n tokens cut into 8 documents at seeded points; q/k/v (grad) and gout drawn from
    ``g`` in that order.  Returns (offsets, lengths, q, k, v, gout, ids, block-sparse tensors of the documents)."""
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import mods

    cuts = torch.sort(torch.randperm(n - 1, generator=torch.Generator().manual_seed(1))[:7] + 1).values
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).to(torch.int32).cuda()
    lens = (offsets[1:] - offsets[:-1]).tolist()
    q, k, v = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    gout = torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = mods.document_ids(offsets, n)
    mask_b, full_b = _blocks_document(ids, n, bs)
    return offsets, lens, q, k, v, gout, ids, fa.block_sparse_from_mask(mask_b, (bs, bs), full_mask=full_b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mods: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import mods

    h, d, bs = args.heads, args.head_dim, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def timed(fn, q, k, v, gout):
        with torch.no_grad():
            f = time_fn(lambda: fn(q, k, v), iters=args.iters)
        out = fn(q, k, v)[0]  # (out, lse)
        b = time_fn(lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True), iters=args.iters)
        return f, b

    def record(case, seqlen, base, ours, extra):
        row = dict(case=case, seqlen=seqlen, heads=h, d=d, tokens=args.tokens, device=torch.cuda.get_device_name(),
                   base_fwd_ms=base[0], base_bwd_ms=base[1], mods_fwd_ms=ours[0], mods_bwd_ms=ours[1],
                   fwd_ratio=ours[0] / base[0], bwd_ratio=ours[1] / base[1], target_ratio=1.10, **extra)
        row["meets_target"] = row["fwd_ratio"] <= 1.10 and row["bwd_ratio"] <= 1.10
        rows.append(row)
        print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}),
              flush=True)

    for s in (4096, 16384):
        b = max(1, args.tokens // s)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        gout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        diag, below = _blocks_causal(s, bs)
        bst = fa.block_sparse_from_mask(diag, (bs, bs), full_mask=below)
        causal_mod = mods.causal()
        base = timed(lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, causal=True), q, k, v, gout)
        ours = timed(lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, block_sparse_tensors=bst, **causal_mod),
                     q, k, v, gout)
        record("causal", s, base, ours, dict(batch=b))

    n = args.tokens
    offsets, lens, q, k, v, gout, ids, bst = document_case(n, h, d, bs, g)
    doc_mod = mods.document()
    mx = max(lens)
    base = timed(lambda q_, k_, v_: fa.flash_attn_varlen_func(q_[0], k_[0], v_[0], cu_seqlens_q=offsets,
                                                               cu_seqlens_k=offsets, max_seqlen_q=mx,
                                                               max_seqlen_k=mx),
                 q, k, v, gout[0])
    ours = timed(lambda q_, k_, v_: fa.flash_attn_func(q_, k_, v_, block_sparse_tensors=bst, aux_tensors=[ids],
                                                        **doc_mod), q, k, v, gout)
    record("document", n, base, ours, dict(documents=lens))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
