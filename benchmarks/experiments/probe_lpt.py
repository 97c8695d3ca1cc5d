"""A/B of the causal forward's launch order in one process (a tuning aid for issue 11, not the peer benchmark):
config.FWD_LPT_ORDER on (every head's longest tile launches before any second-longest, kernels/fwd_base.py
``cta_coords``) against off (tile columns reversed inside each head only), on bench_fwd's causal cells.

    python benchmarks/experiments/probe_lpt.py [--only mha-d64 ...] [--seqlens 1024 4096] [--rounds 3] [--out F]

Each round times both orders (CUDA-event medians after warm-up, bench_fwd.time_fn); the kernels of the two orders
are compiled separately and swapped into jit's memory cache (the disk cache is off).  Reported: ms and
TFLOPS per order (median over rounds) and on/off speedup.  Outputs of the two orders are compared first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["FA4_SM120_DISK_CACHE"] = "0"  # the order is not part of the compile key: never reuse a cached kernel

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_fwd import SEQLENS, SHAPES, TOKENS, append_jsonl, flops, time_fn  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--seqlens", nargs="*", type=int, default=list(SEQLENS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--varlen", action="store_true", help="also a varlen causal call (the extra grid column)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config, jit

    memory = {True: {}, False: {}}  # each order's compiled kernels, swapped into jit's memory cache

    def set_order(on: bool):
        memory[config.FWD_LPT_ORDER].update(jit._MEMORY)
        config.FWD_LPT_ORDER = on
        jit._MEMORY.clear()
        jit._MEMORY.update(memory[on])
        config.clear_caches()

    rows = []
    for name, (hq, hkv, d) in SHAPES.items():
        if args.only and name not in args.only:
            continue
        for s in args.seqlens:
            b = max(1, TOKENS // s)
            g = torch.Generator(device="cuda").manual_seed(s + d)
            q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
            calls = {"dense": lambda: fa.flash_attn_func(q, k, v, causal=True)}
            if args.varlen:
                cu = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
                qv, kv_, vv = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
                calls["varlen"] = lambda: fa.flash_attn_varlen_func(qv, kv_, vv, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                    max_seqlen_q=s, max_seqlen_k=s, causal=True)
            for kind, call in calls.items():
                outs, times = {}, {True: [], False: []}
                for on in (True, False):
                    set_order(on)
                    out = call()
                    outs[on] = out[0] if isinstance(out, tuple) else out
                err = (outs[True].float() - outs[False].float()).abs().max().item()
                for _ in range(args.rounds):
                    for on in (True, False):
                        set_order(on)
                        call()  # compile outside the timing
                        times[on].append(time_fn(call))
                fl = flops(b, hq, s, d, True)
                on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
                row = dict(shape=name, kind=kind, batch=b, seqlen=s, hq=hq, hkv=hkv, d=d, causal=True,
                           lpt_ms=on_ms, plain_ms=off_ms, lpt_tflops=fl / on_ms / 1e9, plain_tflops=fl / off_ms / 1e9,
                           speedup=off_ms / on_ms, max_abs_diff=err, rounds=args.rounds,
                           device=torch.cuda.get_device_name())
                rows.append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    set_order(True)
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
