"""Paged vs contiguous K/V on the same kernel (issue 8 tuning aid): times flash_attn_with_kvcache (num_splits=1 and
auto, CUDA-graph replays) on a contiguous cache with the dispatcher's tile, on the same cache forced onto the paged
path's cp.async tile, and on paged caches (the dispatcher's kernel: TMA on prefill calls whose page size is a
multiple of the tile's tile_n, ``paged_tma_eligible`` in the output, decode and split calls keep cp.async;
``paged_cpasync`` forces the cp.async kernel); with ``--ncu`` it runs each variant once, for Nsight Compute:

    python benchmarks/experiments/paged_vs_contiguous.py                                  # decode (q_len 1)
    python benchmarks/experiments/paged_vs_contiguous.py --q-len 512 --shapes 1x8192      # chunked prefill, causal
    ncu --kernel-name regex:fwd_cpasync --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/experiments/paged_vs_contiguous.py --ncu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_decode import copy_gbps, make_cache, time_graph  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=["64x2048", "8x8192"])
    ap.add_argument("--q-len", type=int, default=1, help="query rows per sequence (> 1: causal chunked prefill)")
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config as C
    from flash_attn_4_sm120 import config_decode as CD
    from flash_attn_4_sm120 import dispatch as D

    copy_bw = None if args.ncu else copy_gbps()
    orig = D.select_fwd_tile
    orig_tma = D.paged_eligible_for_tma
    sq = args.q_len
    with torch.no_grad():
        for shape in args.shapes:
            b, kv = (int(x) for x in shape.split("x"))
            for variant, ps in (("contiguous", 0), ("contiguous_cpasync", 0), ("contiguous_decode", 0),
                                ("paged", 16), ("paged", 64), ("paged", 256), ("paged_cpasync", 64),
                                ("paged_decode", 16), ("paged_decode", 64)):
                gen = torch.Generator(device="cuda").manual_seed(0)
                kc, vc, table = make_cache(b, kv, 8, 128, ps, gen)
                q = torch.randn(b, sq, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
                if variant == "contiguous_cpasync":
                    D.select_fwd_tile = lambda d, dv, w, paged=False: orig(d, dv, w, True)
                if variant.endswith("_decode"):  # the decode tile on unsplit calls too
                    D.select_fwd_tile = lambda d, dv, w, paged=False: CD.decode_tile(d, dv)
                if variant in ("paged_cpasync", "paged_decode"):  # never the TMA kernel
                    D.paged_eligible_for_tma = lambda *a, **kw: False
                paged_tma = table is not None and D.paged_eligible_for_tma(kc, vc, 128, 128, sq > 1)
                C.clear_caches()
                try:
                    for n in (1, 0):
                        def fn(n=n, kc=kc, vc=vc, table=table, q=q, seqlens=seqlens):
                            return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                                              causal=sq > 1, num_splits=n)
                        if args.ncu:
                            fn()
                            torch.cuda.synchronize()
                            continue
                        ms = time_graph(fn)
                        gbps = b * kv * 8 * 128 * 4 / ms / 1e6
                        print(json.dumps(dict(batch=b, kv_len=kv, q_len=sq, variant=variant, page_size=ps or None,
                                              paged_tma_eligible=paged_tma, splits=n,
                                              graph_us=round(ms * 1e3, 1), pct_of_copy=round(gbps / copy_bw, 3))),
                              flush=True)
                finally:
                    D.select_fwd_tile = orig
                    D.paged_eligible_for_tma = orig_tma
                    C.clear_caches()
                del kc, vc, table
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
