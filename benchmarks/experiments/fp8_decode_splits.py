"""FP8-cache decode: time per split count (issue 34's cells), to check dispatch_fp8.fp8_splits' automatic rule;
with --tiles, the decode tile's shape against the one-warp tile it replaced.

    python benchmarks/experiments/fp8_decode_splits.py --out benchmarks/experiments/results/fp8_decode_splits_<gpu>.jsonl
    python benchmarks/experiments/fp8_decode_splits.py --tiles   # -> results/fp8_decode_tiles_<gpu>.jsonl (~2 min)

--tiles: issue 34's cells (B=8 KV 8K, B=64 KV 2K; contiguous and paged with pages of 16 rows) and B=1 KV 8K / 32K,
each with the default call (automatic split-KV) of the bf16 cache and of the e4m3 cache under two packed decode
tiles, selected through config_fp8's FP8_DECODE_WARPS / FP8_DECODE_KV_WARPS for the run (an experiment switch, not
an argument of the package): ``w1`` the one-warp 16-row tile (num_warps 1; its split rule counts a CTA as a quarter
of a four-warp one) and ``w2kw2`` two warps splitting each K/V tile's keys (config_fp8's default).  At B=1 the
tiles are also timed at num_splits 16, 32 and 64.  Each FP8 output is compared with the one-warp tile's (the same
inputs; the key split rounds P per warp, so a gap over 5e-2 RMS is recorded as an error and not timed).

One decode step (q_len 1, Hq 32 / Hkv 8, d128, contiguous cache, every key valid) at B=8 KV 8K and B=64 KV 2K: the
bf16 cache's default call, then the e4m3 cache with a bf16 query (quantized per (row, head) in the kernel) at
num_splits 0 (automatic) and 1, 2, 4, 8, 16, 32, packed (pack_gqa=None, the default) and unpacked.  Median ms of
CUDA-graph replays (bench_decode.time_graph); each FP8 output is first compared with the automatic call's (the same
inputs: a split differs by P's e4m3 rounding only, so a gap over 5e-2 RMS is recorded as an error and not timed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]
from bench_decode import copy_gbps, gpu_tag, time_graph  # noqa: E402

HQ, HKV, D = 32, 8, 128
CELLS = ((8, 8192), (64, 2048))
SPLITS = (0, 1, 2, 4, 8, 16, 32)
TILE_CELLS = ((8, 8192, False), (8, 8192, True), (64, 2048, False), (64, 2048, True), (1, 8192, False),
              (1, 32768, False))  # (batch, kv_len, paged with pages of 16 rows)
TILES = {"w1": (1, 1), "w2kw2": (2, 2)}  # (FP8_DECODE_WARPS, FP8_DECODE_KV_WARPS)
B1_SPLITS = (16, 32, 64)


@contextlib.contextmanager
def decode_tile(warps: int, kv_warps: int):
    """Select the packed decode tile for the calls inside (config_fp8.select_config reads these at call time)."""
    from flash_attn_4_sm120 import config_fp8 as C

    old = C.FP8_DECODE_WARPS, C.FP8_DECODE_KV_WARPS
    C.FP8_DECODE_WARPS, C.FP8_DECODE_KV_WARPS = warps, kv_warps
    try:
        yield
    finally:
        C.FP8_DECODE_WARPS, C.FP8_DECODE_KV_WARPS = old


def run_tiles(fa, Q, copy_bw):
    """The --tiles rows: one per (cell, tile, split count) and a bf16 row per cell."""
    from bench_fp8_decode import PAGE_SIZE, page_table, paged

    rows = []
    with torch.no_grad():
        for b, kv, is_paged in TILE_CELLS:
            gen = torch.Generator(device="cuda").manual_seed(b * 7 + kv)
            q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            kc, vc = (torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
            _, k8, v8, _, kd, vd = Q.quantize_qkv(q, kc, vc)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            extra = {}
            if is_paged:
                table = page_table(b, kv, gen)
                kc, vc, k8, v8 = (paged(t, table) for t in (kc, vc, k8, v8))
                extra = dict(page_table=table)
            cell = dict(batch=b, kv_len=kv, paged=PAGE_SIZE if is_paged else None)
            fp8_bytes = 2 * b * kv * HKV * D
            bf16_ms = time_graph(lambda: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, **extra))
            rows.append(dict(cell, impl="bf16", ms=bf16_ms, pct_of_copy=2 * fp8_bytes / bf16_ms / 1e6 / copy_bw))
            print(json.dumps(rows[-1]), flush=True)
            base = None
            for tile, (warps, kv_warps) in TILES.items():
                for splits in (None,) + (B1_SPLITS if b == 1 else ()):
                    row = dict(cell, impl="fp8", tile=tile, num_splits=splits)
                    with decode_tile(warps, kv_warps):
                        def call():
                            return fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd,
                                                              v_descale=vd, num_splits=splits, **extra)

                        try:
                            out = call().float()
                            if base is None:
                                base = out
                            gap = float((out - base).pow(2).mean().sqrt())
                            row["rms_vs_w1"] = gap
                            if gap > 5e-2:
                                raise RuntimeError(f"rms {gap:.3e} against the one-warp tile")
                            ms = time_graph(call)
                        except Exception as exc:  # noqa: BLE001 - recorded, the other rows still run
                            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        else:
                            row.update(ms=ms, speedup_vs_bf16=bf16_ms / ms, pct_of_copy=fp8_bytes / ms / 1e6 / copy_bw)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiles", action="store_true", help="time the packed decode tiles (TILES) instead")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_decode_splits: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import fp8_quant as Q

    copy_bw = copy_gbps()
    rows = [dict(kind="meta", device=torch.cuda.get_device_name(), copy_gbps=copy_bw)]
    if args.tiles:
        rows += run_tiles(fa, Q, copy_bw)
        out = args.out or HERE / "results" / f"fp8_decode_tiles_{gpu_tag()}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {out}")
        return 0
    with torch.no_grad():
        for b, kv in CELLS:
            gen = torch.Generator(device="cuda").manual_seed(b * 7 + kv)
            q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            kc, vc = (torch.randn(b, kv, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
            _, k8, v8, _, kd, vd = Q.quantize_qkv(q, kc, vc)
            seqlens = torch.full((b,), kv, dtype=torch.int32, device="cuda")
            fp8_bytes = 2 * b * kv * HKV * D
            bf16_ms = time_graph(lambda: fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens))
            auto = fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd, v_descale=vd)
            for pack in (None, False):
                for splits in SPLITS:
                    row = dict(batch=b, kv_len=kv, pack_gqa=pack, num_splits=splits, bf16_ms=bf16_ms)

                    def call():
                        return fa.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=kd,
                                                          v_descale=vd, num_splits=splits, pack_gqa=pack)

                    try:
                        gap = float((call().float() - auto.float()).pow(2).mean().sqrt())
                    except Exception as exc:  # noqa: BLE001 - a refused count is recorded, not fatal
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    else:
                        row["rms_vs_auto"] = gap
                        if gap > 5e-2:
                            row["error"] = f"rms {gap:.3e} against the automatic call"
                        else:
                            ms = time_graph(call)
                            row.update(fp8_ms=ms, speedup_vs_bf16=bf16_ms / ms,
                                       pct_of_copy=fp8_bytes / ms / 1e6 / copy_bw)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = args.out or HERE / "results" / f"fp8_decode_splits_{gpu_tag()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
