"""A/B of the causal backward's launch order in one process (a tuning aid for issue 30, not the peer benchmark):
config_bwd.BWD_LPT_ORDER on (every (KV head, batch)'s longest key tile launches before any second-longest,
kernels/bwd_dkdv.py ``cta_coords``) against off (key tiles in order inside each head), on bench_bwd's causal cells
and the chunked-prefill cell.

    python benchmarks/experiments/probe_lpt_bwd.py [--only mha-d64 ...] [--seqlens 1024 4096] [--rounds 3] [--out F]

Each round times both orders (CUDA-event medians after warm-up, bench_fwd.time_fn) of the backward alone
(torch.autograd.grad over one forward); the kernels of the two orders are compiled separately and swapped into
jit's memory cache and dispatch_bwd's fused-kernel memo (the disk cache and the prebuilt set are off).  Reported:
ms and TFLOPS per order (median over rounds), the grid's key-tile columns and the on/off speedup.  The gradients of
the two orders are compared first (the fused dQ's fp32 adds may reorder: a small difference is expected there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["FA4_SM120_DISK_CACHE"] = "0"  # the order is not part of the compile key: never reuse a cached kernel
os.environ["FA4_SM120_PREBUILT"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import (CHUNKED_CELL, EXTRA_CELLS, SEQLENS, SHAPES, TOKENS, append_jsonl, chunked_flops,  # noqa: E402
                       flops, time_fn)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd, jit

    memory = {True: {}, False: {}}  # each order's jit memory

    def set_order(on: bool):
        memory[config_bwd.BWD_LPT_ORDER].update(jit._MEMORY)
        config_bwd.BWD_LPT_ORDER = on
        jit._MEMORY.clear()
        dispatch_bwd.clear_caches()  # the plans (and the fused kernels they hold) refill from this order's memory
        jit._MEMORY.update(memory[on])

    cells = [(name, hq, hkv, d, s, s, max(1, TOKENS // s)) for name, (hq, hkv, d) in SHAPES.items()
             if not args.only or name in args.only for s in args.seqlens]
    if not args.only:
        cells += [(name, hq, hkv, d, s, s, max(1, TOKENS // s)) for name, (hq, hkv, d, s) in EXTRA_CELLS.items()]
        name, (hq, hkv, d, sq, sk, b) = CHUNKED_CELL
        cells.append((name, hq, hkv, d, sq, sk, b))
    rows = []
    for name, hq, hkv, d, s, sk, b in cells:
        g = torch.Generator(device="cuda").manual_seed(s + d)
        mk = lambda n, h: torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                                      generator=g).requires_grad_()
        q, k, v = mk(s, hq), mk(sk, hkv), mk(sk, hkv)
        gout = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        out = fa.flash_attn_func(q, k, v, causal=True)
        out = out[0] if isinstance(out, tuple) else out  # (out, lse), as flash-attn-4 returns
        call = lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)  # noqa: E731
        grads, times = {}, {True: [], False: []}
        for on in (True, False):
            set_order(on)
            grads[on] = call()
        diff = max((a.float() - c.float()).abs().max().item() for a, c in zip(grads[True], grads[False]))
        scale = max(c.float().abs().max().item() for c in grads[False])
        for _ in range(args.rounds):
            for on in (True, False):
                set_order(on)
                times[on].append(time_fn(call))
        fl = 2.5 * (chunked_flops(b, hq, s, sk, d) if sk != s else flops(b, hq, s, d, True))
        on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
        row = dict(shape=name, batch=b, seqlen=s, seqlen_k=sk, hq=hq, hkv=hkv, d=d, causal=True,
                   lpt_ms=on_ms, plain_ms=off_ms, lpt_tflops=fl / on_ms / 1e9, plain_tflops=fl / off_ms / 1e9,
                   speedup=off_ms / on_ms, max_abs_diff=diff, max_abs_grad=scale, rounds=args.rounds,
                   device=torch.cuda.get_device_name())
        rows.append(row)
        print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}), flush=True)
        del q, k, v, gout, out, grads
    set_order(True)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
