"""Dropout cost at d128 (issue 10's target: p = 0.1, S = 4096, forward and backward each >= 0.85x of the same
call without dropout), one process, CUDA-event timing (median).

    python benchmarks/bench_dropout.py --out benchmarks/results/dropout_h100.jsonl

Rows: one per (direction, causal, seqlen) with ms and TFLOPS without and with dropout and their ratio
(time without / time with: >= 0.85 meets the target).  The dropout calls draw seed/offset from torch's
generator, as training does.  TFLOPS by the FlashAttention convention (backward: 2.5x the forward FLOPs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fwd import flops, time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=[4096])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
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
            for p in (0.0, args.p):
                def fwd():
                    return fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]

                with torch.no_grad():
                    res[("fwd", p)] = time_fn(fwd)
                out = fwd()
                dout = torch.randn_like(out)
                res[("bwd", p)] = time_fn(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
            for direction, mult in (("fwd", 1.0), ("bwd", 2.5)):
                base, drop = res[(direction, 0.0)], res[(direction, args.p)]
                row = dict(
                    bench="dropout", direction=direction, causal=causal, seqlen=s, batch=b, heads=args.heads,
                    head_dim=d, dropout_p=args.p, ms_no_dropout=round(base, 4), ms_dropout=round(drop, 4),
                    tflops_no_dropout=round(mult * f / base / 1e9, 1), tflops_dropout=round(mult * f / drop / 1e9, 1),
                    ratio=round(base / drop, 3), target=0.85, meets_target=base / drop >= 0.85,
                    device=torch.cuda.get_device_name(), torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M"),
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
