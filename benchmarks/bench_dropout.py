"""Dropout cost at d128 (issue 10's target: p = 0.1, S = 4096, forward and backward each >= 0.85x of the same
call without dropout), one process, CUDA-event timing (median).

The two calls of a pair (without and with dropout) are timed call by call in alternation (``time_alternating``):
each sees the same clocks and the same warmth of the GPU.  ``--timing sequential`` times them as this script did
before: 20 calls each, in the order fwd p=0, bwd p=0, fwd p, bwd p.

    python benchmarks/bench_dropout.py --out benchmarks/results/dropout_h100.jsonl

Rows: one per (direction, causal, seqlen) with ms and TFLOPS without and with dropout and their ratio
(time without / time with: >= 0.85 meets the target).  The dropout calls draw seed/offset from torch's
generator, as training does.  TFLOPS by the FlashAttention convention (backward: 2.5x the forward FLOPs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import flops, time_fn  # noqa: E402


def time_alternating(fa, fb, iters=60, warmup=5):
    """(median ms of fa, median ms of fb): calls a, b, a, b, ... each between its own CUDA events, after ``warmup``
    calls of each."""
    for _ in range(warmup):
        fa()
        fb()
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for e0, e1, e2 in ev:
        e0.record()
        fa()
        e1.record()
        fb()
        e2.record()
    torch.cuda.synchronize()
    ta = statistics.median(e0.elapsed_time(e1) for e0, e1, _ in ev)
    tb = statistics.median(e1.elapsed_time(e2) for _, e1, e2 in ev)
    return ta, tb


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=[4096])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--timing", choices=("alternating", "sequential"), default="alternating")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dropout: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    d = 128
    rows = []
    for s in args.seqlens:
        b = max(1, args.tokens // s)
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, s, args.heads, d, device="cuda", generator=g, dtype=torch.float32)
                       .to(torch.bfloat16).requires_grad_() for _ in range(3))
            f = flops(b, args.heads, s, d, causal)
            res = {}

            def fwd(p):
                return fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]

            outs = {p: fwd(p) for p in (0.0, args.p)}
            dout = torch.randn_like(outs[0.0])
            bwd = {p: (lambda o=outs[p]: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
                   for p in (0.0, args.p)}
            if args.timing == "alternating":
                with torch.no_grad():
                    res[("fwd", 0.0)], res[("fwd", args.p)] = time_alternating(lambda: fwd(0.0), lambda: fwd(args.p))
                res[("bwd", 0.0)], res[("bwd", args.p)] = time_alternating(bwd[0.0], bwd[args.p], iters=30)
            else:
                for p in (0.0, args.p):
                    with torch.no_grad():
                        res[("fwd", p)] = time_fn(lambda: fwd(p))
                    res[("bwd", p)] = time_fn(bwd[p])
            for direction, mult in (("fwd", 1.0), ("bwd", 2.5)):
                base, drop = res[(direction, 0.0)], res[(direction, args.p)]
                row = dict(
                    bench="dropout", direction=direction, causal=causal, seqlen=s, batch=b, heads=args.heads,
                    head_dim=d, dropout_p=args.p, ms_no_dropout=round(base, 4), ms_dropout=round(drop, 4),
                    tflops_no_dropout=round(mult * f / base / 1e9, 1), tflops_dropout=round(mult * f / drop / 1e9, 1),
                    ratio=round(base / drop, 3), target=0.85, meets_target=base / drop >= 0.85,
                    device=torch.cuda.get_device_name(), torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M"),
                    timing=args.timing,
                )
                rows.append(row)
                print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
