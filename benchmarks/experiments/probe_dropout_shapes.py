"""Probe (issue 10): the forward's dropout ratio (time without / with, p = 0.1, d128, bf16) across sequence
lengths and masks at a fixed token count, to separate per-tile from per-CTA costs of dropout.

    python benchmarks/experiments/probe_dropout_shapes.py --out benchmarks/experiments/results/dropout_shapes_h100.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_dropout_shapes: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    rows = []
    for s in args.seqlens:
        b = max(1, args.tokens // s)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, args.heads, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        for mask, kw in (("none", {}), ("causal", {"causal": True}), ("window", {"window_size": (s // 2, s // 2)})):
            t = {}
            for p in (0.0, args.p):
                with torch.no_grad():
                    t[p] = time_fn(lambda: fa.flash_attn_func(q, k, v, dropout_p=p, **kw)[0], iters=30)
            row = dict(probe="dropout_shapes", seqlen=s, batch=b, heads=args.heads, mask=mask, ms_no_dropout=round(t[0.0], 4),
                       ms_dropout=round(t[args.p], 4), ratio=round(t[0.0] / t[args.p], 3),
                       device=torch.cuda.get_device_name())
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
