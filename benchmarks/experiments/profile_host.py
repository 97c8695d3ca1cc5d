"""Where the host time of one call goes: cProfile over many back-to-back calls of the tiny problem of
bench_host.py (B=1, S=128, Hq 8 / Hkv 2, d128, bf16, causal), forward and forward+backward, plus the GPU kernels
of one forward+backward (torch.profiler), to tell host-bound from GPU-bound.

    python benchmarks/experiments/profile_host.py [--calls 500] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_host: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    gout = torch.randn_like(q)

    def fwd():
        fa.flash_attn_func(q, k, v, causal=True)

    def fwd_bwd():
        out, _ = fa.flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), gout)

    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"==== {name}: {args.calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            fwd_bwd()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
