"""Per-kernel CUDA times (torch.profiler) of bench_mods.py's cases: the built-in call against the block mask +
mask_mod call, forward and backward, so a gap in the benchmark can be put on a kernel; and of bench_dropout.py's
(the call without dropout against p = 0.1).

    python benchmarks/experiments/profile_mods.py [--case causal4k|causal16k|document|dropout|dropout_causal] \\
        [--iters 10]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_mods import _blocks_causal, document_case  # noqa: E402


def _kernel_times(fn, iters):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:90]] += ev.device_time / iters
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="causal4k", choices=["causal4k", "causal16k", "document", "dropout",
                                                                  "dropout_causal"])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import mods

    h, d, bs, n = 16, 128, 128, 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.case.startswith("causal"):
        s = 4096 if args.case == "causal4k" else 16384
        b = n // s
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        gout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        diag, below = _blocks_causal(s, bs)
        bst = fa.block_sparse_from_mask(diag, (bs, bs), full_mask=below)
        calls = {"base": lambda: fa.flash_attn_func(q, k, v, causal=True),
                 "mods": lambda: fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, **mods.causal()),
                 "sparse_causal_no_mod": lambda: fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, causal=True)}
    elif args.case.startswith("dropout"):
        causal = args.case == "dropout_causal"
        q, k, v = (torch.randn(4, 4096, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        gout = torch.randn(4, 4096, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        calls = {"base": lambda: fa.flash_attn_func(q, k, v, causal=causal, return_lse=True),
                 "mods": lambda: fa.flash_attn_func(q, k, v, causal=causal, dropout_p=0.1, dropout_seed=1,
                                                    return_lse=True)}
    else:
        offsets, lens, q, k, v, gout, ids, bst = document_case(n, h, d, bs, g)
        mx = max(lens)
        calls = {"base": lambda: fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=offsets,
                                                           cu_seqlens_k=offsets, max_seqlen_q=mx, max_seqlen_k=mx),
                 "mods": lambda: fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, aux_tensors=[ids],
                                                    **mods.document())}
    for name, call in calls.items():
        with torch.no_grad():
            fwd = _kernel_times(call, args.iters)
        out = call()[0]
        go = gout[0] if out.dim() == 3 else gout
        bwd = _kernel_times(lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True), args.iters)
        for phase, times in (("fwd", fwd), ("bwd", bwd)):
            total = sum(times.values())
            print(f"{args.case} {name} {phase}: {total / 1e3:.3f} ms")
            for kname, t in sorted(times.items(), key=lambda x: -x[1]):
                print(f"    {t / 1e3:8.3f} ms  {kname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
