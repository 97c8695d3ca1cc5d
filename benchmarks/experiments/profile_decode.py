"""Decode tile/split sweep (issue 8 tuning aid, not a peer benchmark): for the decode cases of bench_decode.py, time
flash_attn_with_kvcache with each candidate split tile and split count, eagerly and as a replayed CUDA graph (the
graph removes the host cost, which is what a serving engine that captures its decode step sees), and print the
per-kernel GPU times of one call from torch.profiler.

    python benchmarks/experiments/profile_decode.py [--out benchmarks/experiments/results/decode_tiles_<gpu>.jsonl]

The tile override patches the dispatcher's split-tile rule for the duration of one measurement (config.clear_caches
before and after), so every row runs the same public call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the bench_* modules
from bench_decode import copy_gbps, gpu_tag, make_cache, time_graph  # noqa: E402
from bench_fwd import time_fn  # noqa: E402

CASES = (  # name, batch, kv_len, hq, hkv, d, page_size
    ("d128", 1, 32768, 32, 8, 128, 0),
    ("d128_p64", 1, 32768, 32, 8, 128, 64),
    ("mqa", 1, 32768, 32, 1, 128, 0),
    ("d128", 8, 8192, 32, 8, 128, 0),
    ("d256", 1, 32768, 32, 8, 256, 0),
)


def kernel_times(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            out[e.key[:60]] = round(e.device_time_total / e.count, 2)  # us per call
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiles", nargs="*", default=None, help="tile names to try (default: a built-in list)")
    ap.add_argument("--splits", nargs="*", type=int, default=[0, 8, 16, 32, 64])
    args = ap.parse_args(argv)
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import config as C
    from flash_attn_4_sm120 import dispatch as D

    tiles = {t.name(): t for t in (
        C.FwdTile(128, 64, 8, 2, True), C.FwdTile(64, 64, 4, 2), C.FwdTile(64, 64, 4, 3), C.FwdTile(64, 32, 4, 2),
        C.FwdTile(64, 128, 4, 1), C.FwdTile(64, 32, 4, 1))}
    names = ["default"] + (args.tiles if args.tiles is not None else list(tiles))
    copy_bw = copy_gbps()
    print(json.dumps({"copy_gbps": round(copy_bw, 1), "device": torch.cuda.get_device_name()}), flush=True)
    rows = []
    orig = D.split_tile
    with torch.no_grad():
        for case, b, kv, hq, hkv, d, ps in CASES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            kc, vc, table = make_cache(b, kv, hkv, d, ps, gen)
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            kv_bytes = b * kv * hkv * d * 4
            ref = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table, num_splits=1)
            for name in names:
                tile = tiles.get(name)
                if tile is not None and C.fwd_tile_problems(d, d, tile):
                    continue
                D.split_tile = orig if tile is None else (lambda t, _tile=tile: _tile)
                C.clear_caches()
                try:
                    for n in args.splits:
                        def fn(n=n, kc=kc, vc=vc, table=table, q=q, seqlens=seqlens):
                            return fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table,
                                                              num_splits=n)
                        try:
                            err = (fn().float() - ref.float()).abs().max().item()
                        except Exception as exc:  # noqa: BLE001 - a tile that cannot run this case is recorded
                            rows.append(dict(case=case, batch=b, tile=name, splits=n,
                                             error=f"{type(exc).__name__}: {str(exc)[:160]}"))
                            print(json.dumps(rows[-1]), flush=True)
                            continue
                        row = dict(case=case, batch=b, kv_len=kv, hkv=hkv, d=d, page_size=ps or None, tile=name,
                                   splits=n, max_err=err, eager_ms=time_fn(fn, warmup=5, iters=30),
                                   graph_ms=time_graph(fn))
                        row["graph_pct_of_copy"] = kv_bytes / row["graph_ms"] / 1e6 / copy_bw
                        row["eager_pct_of_copy"] = kv_bytes / row["eager_ms"] / 1e6 / copy_bw
                        if n == 0 and name == "default":
                            row["kernels_us"] = kernel_times(fn)
                        rows.append(row)
                        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}),
                              flush=True)
                finally:
                    D.split_tile = orig
                    C.clear_caches()
            del kc, vc, table
            torch.cuda.empty_cache()
    out = args.out or Path(__file__).parent / "results" / f"decode_tiles_{gpu_tag()}.jsonl"
    with out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
