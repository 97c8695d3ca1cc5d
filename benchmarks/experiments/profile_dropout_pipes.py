"""One forward call without and one with dropout (d128, S=4096, p=0.1, as bench_dropout.py), each inside a CUDA
profiler range, for Nsight Compute's pipe and stall metrics:

    ncu --profile-from-start off --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --csv python benchmarks/experiments/profile_dropout_pipes.py [--causal]

The compiles and a warm-up call of each run before the ranges, so only the two attention kernels are profiled.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seqlen", type=int, default=4096)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_dropout_pipes: no CUDA GPU", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa

    g = torch.Generator(device="cuda").manual_seed(0)
    b = max(1, 16384 // args.seqlen)
    q, k, v = (torch.randn(b, args.seqlen, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    calls = [lambda p=p: fa.flash_attn_func(q, k, v, causal=args.causal, dropout_p=p) for p in (0.0, 0.1)]
    with torch.no_grad():
        for c in calls:  # compile + warm up outside the profiled ranges
            c()
        torch.cuda.synchronize()
        for c in calls:
            torch.cuda.profiler.start()
            c()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
