"""Per-kernel GPU time of the d128 dropout calls of bench_dropout (S=4096, B=4, H=16, p=0.1 and p=0), forward and
backward, causal and not, from torch.profiler: which kernel a dropout change moved.

    python benchmarks/experiments/profile_dropout_kernels.py [--tag NAME]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", default="")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="no torch.profiler (run under ncu: sm__cycles_elapsed)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_dropout_kernels: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from torch.profiler import ProfilerActivity, profile

    b, s, h, d = 4, 4096, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    for causal in (False, True):
        for p in (0.0, 0.1):
            out = fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]
            dout = torch.randn_like(out)
            for _ in range(args.warmup):
                torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0], (q, k, v), dout)
            torch.cuda.synchronize()
            if args.plain:
                for _ in range(args.iters):
                    o = fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]
                    torch.autograd.grad(o, (q, k, v), dout)
                torch.cuda.synchronize()
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    o = fa.flash_attn_func(q, k, v, causal=causal, dropout_p=p)[0]
                    torch.autograd.grad(o, (q, k, v), dout)
                torch.cuda.synchronize()
            per = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    name = e.name
                    for key in ("FlashFwd", "FlashBwdDkdvKvRows", "FlashBwdDq", "FlashBwdDkdv", "Preprocess", "Convert"):
                        if key in name:
                            name = key
                            break
                    else:
                        name = name[:40]
                    per[name] += e.device_time / 1000.0 / args.iters
            row = dict(tag=args.tag, causal=causal, p=p, ms={k2: round(v2, 4) for k2, v2 in sorted(per.items())})
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
