"""Host-path profile of the decode calls (a tuning aid; profile_host.py does the prefill problem): cProfile of
repeated calls on a tiny problem, so the per-call Python cost shows by function.  Cases: dense flash_attn_func; flash_attn_with_kvcache decode (B=1, Hq 32 /
Hkv 8, d128, KV 4K) with num_splits=1 and automatic splits, contiguous and paged.

    python benchmarks/experiments/profile_host_decode.py [--calls 500] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="pstats sort key: tottime or cumulative")
    ap.add_argument("--only", nargs="*", default=None, help="case names")
    ap.add_argument("--micro", action="store_true", help="time the pieces of a split call's combine launch")
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa

    dev, dt = "cuda", torch.bfloat16
    q1 = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kc = torch.randn(1, 4096, 8, 128, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    kp, vp = kc.view(64, 64, 8, 128), vc.view(64, 64, 8, 128)
    table = torch.arange(64, device=dev, dtype=torch.int32).view(1, 64)
    seqlens = torch.full((1,), 4000, device=dev, dtype=torch.int32)
    q = torch.randn(1, 128, 8, 128, device=dev, dtype=dt)
    k = torch.randn(1, 128, 2, 128, device=dev, dtype=dt)
    cases = {
        "dense_fwd": lambda: fa.flash_attn_func(q, k, k, causal=True),
        "kvcache_split1": lambda: fa.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, num_splits=1),
        "kvcache_auto": lambda: fa.flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, num_splits=0),
        "kvcache_paged_auto": lambda: fa.flash_attn_with_kvcache(q1, kp, vp, cache_seqlens=seqlens,
                                                                 page_table=table, num_splits=0),
        "sdpa_flash_fwd": lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(4, 1), k.transpose(1, 2).repeat_interleave(4, 1),
            is_causal=True),
    }
    if args.micro:
        return micro(fa, args.calls)
    with torch.no_grad():
        for name, fn in cases.items():
            if args.only and name not in args.only:
                continue
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host = (time.perf_counter() - t0) / args.calls * 1e6
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(args.sort).print_stats(args.top)
            print(f"=== {name}: {host:.1f} us/call host (unprofiled)")
            print("\n".join(s.getvalue().splitlines()[:args.top + 12]))
    return 0


def micro(fa, calls):
    """Per-call host time of the pieces of the combine launch of a split decode call."""
    from flash_attn_4_sm120 import combine as CB
    from flash_attn_4_sm120.arguments import COMBINE_ARGS

    def per_call(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        return round(t, 1)

    n, b, s, h, d = 16, 1, 1, 32, 128
    o_part = torch.empty((n, b, s, h, d), device="cuda", dtype=torch.float32).normal_()
    l_part = torch.empty((n, b, h, s), device="cuda", dtype=torch.float32).normal_().transpose(2, 3)
    out = torch.empty((b, s, h, d), device="cuda", dtype=torch.bfloat16)
    lse = torch.empty((b, h, s), device="cuda", dtype=torch.float32).transpose(1, 2)
    lse_c = torch.empty((b, s, h), device="cuda", dtype=torch.float32)
    l_part_c = l_part.contiguous()
    CB.launch_combine(o_part, l_part, out, lse)
    from flash_attn_4_sm120.config_combine import combine_split_groups
    from flash_attn_4_sm120.launch import sm_count

    groups = combine_split_groups(b * s * h, n, d, sm_count(out.device))
    cfg = CB.combine_config(o_part.dtype, out.dtype, d, True, groups)
    fn = CB._KERNELS[(cfg, out.device.index)]
    vals = dict(out_partial=o_part, lse_partial=l_part, out=out, lse=lse, num_rows=b * s * h)
    args = COMBINE_ARGS.pack(vals)
    args_c = COMBINE_ARGS.pack(dict(vals, lse_partial=l_part_c, lse=lse_c))
    print(json.dumps({
        "pack_us": per_call(lambda: COMBINE_ARGS.pack(vals)),
        "fn_call_us (transposed lse views)": per_call(lambda: fn(*args)),
        "fn_call_us (contiguous lse)": per_call(lambda: fn(*args_c)),
        "launch_combine_us": per_call(lambda: CB.launch_combine(o_part, l_part, out, lse)),
        "empty_x2_us": per_call(lambda: (torch.empty_like(o_part), torch.empty_like(lse_c))),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
