"""FP8-cache decode: time per split count (issue 34's cells), to check dispatch_fp8.fp8_splits' automatic rule.

    python benchmarks/experiments/fp8_decode_splits.py --out benchmarks/experiments/results/fp8_decode_splits_<gpu>.jsonl

One decode step (q_len 1, Hq 32 / Hkv 8, d128, contiguous cache, every key valid) at B=8 KV 8K and B=64 KV 2K: the
bf16 cache's default call, then the e4m3 cache with a bf16 query (quantized per (row, head) in the kernel) at
num_splits 0 (automatic) and 1, 2, 4, 8, 16, 32, packed (pack_gqa=None, the default) and unpacked.  Median ms of
CUDA-graph replays (bench_decode.time_graph); each FP8 output is first compared with the automatic call's (the same
inputs: a split differs by P's e4m3 rounding only, so a gap over 5e-2 RMS is recorded as an error and not timed).
"""

from __future__ import annotations

import argparse
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_decode_splits: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import fp8_quant as Q

    copy_bw = copy_gbps()
    rows = [dict(kind="meta", device=torch.cuda.get_device_name(), copy_gbps=copy_bw)]
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
