"""A/B of the decode tiles in one process (a tuning aid for issue 8, not the peer benchmark): the shipped table
(config_decode._DECODE_TILES, DECODE_KEY_SPLIT) against variants, on bench_decode's cases.

    python benchmarks/experiments/probe_decode_tiles.py [--variants rows64 keysplit ...] [--splits 0 128] [--out F]

Variants: ``pack16`` / ``pack8`` (the key split, but MQA's 32 query heads packed 16 or 8 per CTA: more head
groups, fewer rows per CTA, the same splits' worth of CTAs from fewer splits), ``rows64`` (config_decode.DECODE_KEY_SPLIT off: every decode call on the 64-row tiles), ``keysplit``
(on: the key-split tiles for <= 32 rows), ``keysplit_2g`` (on, two groups also for <= 16 rows at d <= 128),
``deep4`` / ``deep5`` (the 32-row key-split tile with 4 / 5 stages of 32 keys instead of 2 of 64: more K/V
bytes in flight per CTA), ``deep4_all`` (4-stage 32-key tiles for every decode call at d <= 128).
``--profile``: kernel times (torch.profiler) of each MQA call, forward and combine apart.
Per case and variant: ms per call in an 8-call graph (each call over its own copy of the cache, as
bench_decode's ``layers`` column), ms of a single-call graph, % of a 1 GiB device copy.  Every output is checked
against the unsplit call on the 64-row tile first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_decode import LAYERS, copy_gbps, make_cache, time_graph, time_graph_layers  # noqa: E402
from bench_fwd import append_jsonl  # noqa: E402

CASES = (("mqa", 1, 32768, 32, 1, 128, 0), ("mqa", 8, 8192, 32, 1, 128, 0), ("mqa", 64, 2048, 32, 1, 128, 0),
         ("d128", 1, 32768, 32, 8, 128, 0), ("d128", 8, 8192, 32, 8, 128, 0), ("d128", 64, 2048, 32, 8, 128, 0),
         ("d128_p16", 1, 32768, 32, 8, 128, 16), ("mqa_p64", 1, 32768, 32, 1, 128, 64),
         ("d256", 1, 32768, 32, 8, 256, 0), ("d256", 8, 8192, 32, 8, 256, 0), ("mqa_d256", 8, 8192, 32, 1, 256, 0))


def set_variant(config, config_decode, shipped, name):
    """Put the decode table and switch of variant ``name`` in place (and forget memoised tiles)."""
    import flash_attn_4_sm120.plan as dispatch  # the per-call decode and packing choices

    F = config.FwdTile
    config_decode._DECODE_TILES.clear()
    config_decode._DECODE_TILES.update(shipped)
    dispatch.decode_rows = config_decode.decode_rows
    orig_pack = getattr(set_variant, "orig_pack", None) or dispatch.choose_pack
    set_variant.orig_pack = orig_pack
    dispatch.choose_pack = orig_pack
    if name in ("pack16", "pack8"):  # MQA: pack only 16 / 8 of the 32 query heads per CTA (more head groups)
        config_decode.DECODE_KEY_SPLIT = True
        most = int(name[4:])

        def fewer(pack_gqa, ratio, max_seqlen_q, tile_m, most=most):
            p = orig_pack(pack_gqa, ratio, max_seqlen_q, tile_m)
            return most if p > most and p % most == 0 else p
        dispatch.choose_pack = fewer
    elif name == "keysplit_always":  # the key split even where the grid fills the GPU (config_decode.decode_rows)
        config_decode.DECODE_KEY_SPLIT = True
        dispatch.decode_rows = lambda rows, grid_ctas, num_sms: rows
    elif name == "w8k4":  # the 32-row (MQA) tile on 8 warps: four groups of two split each 64-key tile
        config_decode.DECODE_KEY_SPLIT = True
        config_decode._DECODE_TILES.update(
            {d: ((16, F(16, 64, 4, 2, kv_groups=4)), (32, F(32, 64, 8, 2, kv_groups=4)), (64, F(64, 64, 4, 2)))
             for d in (32, 64, 96, 128)})
    elif name == "rows64":
        config_decode.DECODE_KEY_SPLIT = False
    elif name == "keysplit":
        config_decode.DECODE_KEY_SPLIT = True
    elif name == "keysplit_2g":  # two groups for every few-row call (no 16-row, four-group tile)
        config_decode.DECODE_KEY_SPLIT = True
        config_decode._DECODE_TILES.update(
            {d: ((32, F(32, 64, 4, 2, kv_groups=2)), (64, F(64, 64, 4, 2))) for d in (32, 64, 96, 128)})
    elif name in ("deep4", "deep5"):  # the 32-row tile with 32-key stages, 4 or 5 of them: more bytes in flight
        config_decode.DECODE_KEY_SPLIT = True
        s = int(name[-1])
        config_decode._DECODE_TILES.update(
            {d: ((16, F(16, 64, 4, 2, kv_groups=4)), (32, F(32, 32, 4, s, kv_groups=2)), (64, F(64, 64, 4, 2)))
             for d in (32, 64, 96, 128)})
    elif name == "deep4_all":  # every decode call on 4-stage 32-key tiles (16-row calls on the 32-row tile)
        config_decode.DECODE_KEY_SPLIT = True
        config_decode._DECODE_TILES.update(
            {d: ((32, F(32, 32, 4, 4, kv_groups=2)), (64, F(64, 32, 4, 4))) for d in (32, 64, 96, 128)})
    else:
        raise SystemExit(f"unknown variant {name}")
    config.clear_caches()


def profile_kernels(call, iters: int = 20) -> dict[str, float]:
    """Mean GPU time (us) per launch of each kernel a call runs (torch.profiler, eager calls after warm-up)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if ev.count and t:
            out[ev.key[:60]] = round(t / ev.count, 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="*", default=["rows64", "keysplit"])
    ap.add_argument("--splits", nargs="*", type=int, default=[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config, config_decode

    shipped, shipped_flag = dict(config_decode._DECODE_TILES), config_decode.DECODE_KEY_SPLIT
    copy_bw = copy_gbps()
    rows = []
    with torch.no_grad():
        for case, b, kv, hq, hkv, d, ps in CASES:
            if args.only and case not in args.only:
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            kc, vc, table = make_cache(b, kv, hkv, d, ps, gen)
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            kv_bytes = b * kv * hkv * d * 4
            set_variant(config, config_decode, shipped, "rows64")
            ref = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, num_splits=1)
            caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(LAYERS - 1)]
            for var in args.variants:
                set_variant(config, config_decode, shipped, var)
                for n in args.splits:
                    def call(kc_=kc, vc_=vc, n=n):
                        return fa.flash_attn_with_kvcache(q, kc_, vc_, cache_seqlens=seqlens, page_table=table,
                                                          num_splits=n)
                    err = (call().float() - ref.float()).abs().max().item()
                    fns = [lambda kc_=kc_, vc_=vc_: call(kc_, vc_) for kc_, vc_ in caches]
                    ms8 = time_graph_layers(fns)
                    ms1 = time_graph(call)
                    row = dict(case=case, batch=b, kv_len=kv, hq=hq, hkv=hkv, d=d, page_size=ps or None,
                               variant=var, num_splits=n, max_abs_diff=err, ms_8call=ms8, ms_1call=ms1,
                               pct_copy_8call=kv_bytes / ms8 / 1e6 / copy_bw,
                               pct_copy_1call=kv_bytes / ms1 / 1e6 / copy_bw, copy_gbps=copy_bw,
                               device=torch.cuda.get_device_name())
                    if args.profile:
                        row["kernels_us"] = profile_kernels(call)
                    rows.append(row)
                    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
            del caches
            torch.cuda.empty_cache()
    config_decode._DECODE_TILES.clear()
    config_decode._DECODE_TILES.update(shipped)
    config_decode.DECODE_KEY_SPLIT = shipped_flag
    config.clear_caches()
    append_jsonl(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
