"""FP8 forward (kernels/fwd_fp8.py) beside our bf16 forward, same run, same shapes; each FP8 output checked
against the bf16 output first (RMS of the difference printed, and the cell is dropped when it exceeds 5e-2).

On the H100 proxy ptxas lowers mma.sync e4m3 to f16 HMMA (benchmarks/results/fp8_gate_sm90a.jsonl), so this
answers "how far is the first FP8 kernel from our bf16 forward", not SM120's FP8 speed.

    .venv/bin/python benchmarks/experiments/fp8_fwd_speed.py --out benchmarks/results/fp8_fwd_speed_h100.jsonl
    .venv/bin/python benchmarks/experiments/fp8_fwd_speed.py --softcap 30 --out \
        benchmarks/experiments/results/fp8_softcap_cost_h100.jsonl   # both forwards capped, and the FP8 one
        # uncapped beside them: fp8_softcap_cost = capped / uncapped FP8 time (kernels/fwd_fp8.py softcap_scores)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT), str(ROOT / "benchmarks")]

from bench_fwd import append_jsonl, flops, time_fn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--softcap", type=float, default=0.0, help="cap both forwards (and time FP8 uncapped too)")
    args = ap.parse_args()
    cap = dict(softcap=args.softcap) if args.softcap else {}
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120.fp8_quant import quantize_qkv

    rows = []
    dev = torch.cuda.get_device_name()
    for d in (64, 128):
        for s in (4096, 8192):
            for causal in (False, True):
                b, hq, hkv = max(1, 16384 // s), 32, 8
                q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
                q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
                ref, _ = fa.flash_attn_func(q, k, v, causal=causal, **cap)
                out, _ = fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                                            **cap)
                diff = float((out.float() - ref.float()).pow(2).mean().sqrt())
                row = dict(device=dev, d=d, s=s, b=b, hq=hq, hkv=hkv, causal=causal, rms_fp8_vs_bf16=diff,
                           softcap=args.softcap)
                if diff > 5e-2:
                    row["dropped"] = "FP8 output differs from the bf16 output"
                else:
                    ms_bf16 = time_fn(lambda: fa.flash_attn_func(q, k, v, causal=causal, **cap))
                    ms_fp8 = time_fn(lambda: fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                                v_descale=vd, causal=causal, **cap))
                    if cap:
                        ms_plain = time_fn(lambda: fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                                      v_descale=vd, causal=causal))
                        row.update(ms_fp8_uncapped=ms_plain, fp8_softcap_cost=ms_fp8 / ms_plain)
                    f = flops(b, hq, s, d, causal)
                    row.update(ms_bf16=ms_bf16, ms_fp8=ms_fp8, tflops_bf16=f / ms_bf16 / 1e9,
                               tflops_fp8=f / ms_fp8 / 1e9, fp8_over_bf16=ms_bf16 / ms_fp8)
                print(row, flush=True)
                rows.append(row)
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
