"""Block-sparse benchmark: a random block mask of a given density vs the dense call, forward and backward, one process.

    python benchmarks/bench_block_sparse.py --out benchmarks/results/block_sparse_h100.jsonl

Default problem (issue 9's target): S = 16K, d = 128, bf16, B = 1, 16 heads, (128, 128) blocks, 10% of the blocks
listed (uniformly at random per batch entry, head and query block; non-causal, so "mask" blocks cost what "full"
blocks cost).  Target: sparse >= 7x faster than dense, forward and backward.

Timed regions (median of CUDA-event timed calls, bench_fwd.time_fn):
  fwd            flash_attn_func(q, k, v[, block_sparse_tensors]) without grad
  bwd            torch.autograd.grad of a fixed forward graph (retain_graph), our host pieces included; for the
                 sparse call with the KV-major lists built on the device at each backward ("bwd") and given
                 ("bwd_given", block_sparse_tensors_bwd), so the transpose's cost is visible
  transpose      block_sparse.transpose_block_sparse alone
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--density", type=float, nargs="*", default=[0.1])
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("Q_BLOCK", "KV_BLOCK"))
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_block_sparse: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import block_sparse as BS

    b, s, hq, d = args.batch, args.seqlen, args.heads, args.head_dim
    hkv = args.kv_heads or hq
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(h):
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()

    q, k, v = mk(hq), mk(hkv), mk(hkv)
    gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    bq, bk = args.block
    nq, nk = -(-s // bq), -(-s // bk)

    def fwd_ms(**kw):
        with torch.no_grad():
            return time_fn(lambda: fa.flash_attn_func(q, k, v, **kw), iters=args.iters)

    def bwd_ms(**kw):
        out, _ = fa.flash_attn_func(q, k, v, return_lse=True, **kw)
        return time_fn(lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True), iters=args.iters)

    base = dict(batch=b, seqlen=s, hq=hq, hkv=hkv, d=d, block=[bq, bk], device=torch.cuda.get_device_name())
    dense_fwd, dense_bwd = fwd_ms(), bwd_ms()
    rows = [dict(base, kind="dense", fwd_ms=dense_fwd, bwd_ms=dense_bwd)]
    print(f"dense: fwd {dense_fwd:.3f} ms, bwd {dense_bwd:.3f} ms", flush=True)
    for density in args.density:
        m = torch.rand(b, hq, nq, nk, device="cuda", generator=g) < density
        bst = fa.block_sparse_from_mask(m, (bq, bk))
        tensors = tuple(bst[:2]) + (torch.zeros(1, 1, 1, dtype=torch.int32, device="cuda"),
                                    torch.zeros(1, 1, 1, 1, dtype=torch.int32, device="cuda"))
        bwd_lists = fa.BlockSparseTensors(*BS.transpose_block_sparse(tensors, nk), (bq, bk))
        listed = m.float().mean().item()
        row = dict(base, kind="sparse", density=density, listed_fraction=listed,
                   fwd_ms=fwd_ms(block_sparse_tensors=bst),
                   bwd_ms=bwd_ms(block_sparse_tensors=bst),
                   bwd_given_ms=bwd_ms(block_sparse_tensors=bst, block_sparse_tensors_bwd=bwd_lists),
                   transpose_ms=time_fn(lambda: BS.transpose_block_sparse(tensors, nk), iters=args.iters))
        row["fwd_speedup"] = dense_fwd / row["fwd_ms"]
        row["bwd_speedup"] = dense_bwd / row["bwd_ms"]
        row["bwd_given_speedup"] = dense_bwd / row["bwd_given_ms"]
        rows.append(row)
        print(f"density {density:.2f} (listed {listed:.3f}): fwd {row['fwd_ms']:.3f} ms ({row['fwd_speedup']:.1f}x), "
              f"bwd {row['bwd_ms']:.3f} ms ({row['bwd_speedup']:.1f}x; lists given {row['bwd_given_ms']:.3f} ms, "
              f"{row['bwd_given_speedup']:.1f}x), transpose {row['transpose_ms']:.3f} ms", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
