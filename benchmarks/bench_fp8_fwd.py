"""FP8 prefill benchmark (issue 34, "FP8 prefill"): our e4m3 forward beside our bf16 forward on the same shapes, in
one process, with the GPU's register-only FP8 / bf16 mma.sync ceiling measured first in the same run.

    python benchmarks/bench_fp8_fwd.py      # writes benchmarks/results/fp8_fwd_<gpu>.jsonl (~3 min)

Ceiling: ``experiments/probe_mma_fp8.py``'s kernels (independent accumulator chains on register operands,
m16n8k32 e4m3 against m16n8k16 bf16, fp32 accumulation), TFLOPS of each and their ratio.  Issue 34's target for
each cell is FP8 >= 1.6x our bf16 forward, or >= 0.9 x that ratio where the ratio is below 1.8 (on the H100 proxy,
which has no FP8 mma.sync unit, ptxas lowers the e4m3 form to unpacks and two f16 HMMAs).

Cells: head dims 64 / 128 / 256, S 4K and 8K (batch 16K / S), Hq / Hkv 32 / 8, causal and not: ``flash_attn_func``
on bf16 q/k/v, and on their e4m3 quantization (``fp8_quant.quantize_qkv``: per (batch, KV head) descales) with the
descales.  A cell the FP8 forward does not serve (d256) is recorded with its error.  Checked before timing, on
batch 0 and KV head 0 (its query heads) against an fp32 reference of the UNquantized inputs (refcheck.forward):
bf16 with the tests' bar (2x the error of the same computation in bf16, plus a small atol); FP8 with the FP8 tests'
bar (RMS error at most 1.1x that of the step-by-step emulation of the same quantized inputs, tests/fp8_emulation.py,
and within a fifth of that error plus twice P's rounding RMS of the emulation).  A failing result is recorded as
``<impl>_error`` and not timed.  Times: median ms of CUDA-event timed calls after warm-up (bench_fwd.time_fn);
TFLOPS by FlashAttention's count (bench_fwd.flops).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "experiments"), str(HERE.parent)]
from bench_decode import gpu_tag  # noqa: E402
from bench_fp8_decode import fp8_check as decode_fp8_check  # noqa: E402  (the FP8 tests' bars)
from bench_fwd import flops, time_fn  # noqa: E402
import refcheck  # noqa: E402
from tests.fp8_emulation import emulate_fp8_attention, rms  # noqa: E402

HQ, HKV = 32, 8
TOKENS = 16384
CELLS = tuple((d, s, c) for d in (64, 128, 256) for s in (4096, 8192) for c in (False, True))
SPEEDUP_TARGET, CEILING_RATIO_BAR, CEILING_SHARE = 1.6, 1.8, 0.9


def ceiling() -> list[dict]:
    """The register-only mma.sync rows (bf16, e4m3) and their ratio, probe_mma_fp8's kernels on this GPU."""
    import probe_mma_fp8 as P

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * 8 * 32 * P.WARPS
    out = torch.empty(n, device="cuda", dtype=torch.float32)
    rows = []
    for kind, flop_per_mma in (("bf16", 2 * 16 * 8 * 16), ("e4m3", 2 * 16 * 8 * 32)):
        fn = P.compile_probe(kind)
        ms = time_fn(lambda: fn(out, P.ITERS))
        rows.append(dict(kind="ceiling", mma=kind, ms=ms,
                         tflops=(n // 32) * P.ITERS * P.CHAINS * flop_per_mma / ms / 1e9))
    ratio = rows[1]["tflops"] / rows[0]["tflops"]
    target = SPEEDUP_TARGET if ratio >= CEILING_RATIO_BAR else CEILING_SHARE * ratio
    rows.append(dict(kind="ceiling_ratio", fp8_over_bf16=ratio, target_speedup=target))
    return rows


def fp8_check(out, q, k, v, q8, k8, v8, qd, kd, vd, causal):
    """(problem or None, rms error) on batch 0, KV head 0: bench_fp8_decode.fp8_check's bars (the FP8 tests')
    against the step-by-step emulation of the same quantized inputs."""
    g = HQ // HKV
    sl = (slice(0, 1), slice(None), slice(0, g))
    ref = refcheck.forward(q[sl], k[:1, :, :1], v[:1, :, :1], causal)
    args = (q8[sl], k8[:1, :, :1], v8[:1, :, :1], qd[:1, :1], kd[:1, :1], vd[:1, :1])
    p_rms = rms(*(emulate_fp8_attention(*args, causal=causal, quantize_p=p, out_dtype=torch.float32)
                  for p in (True, False)))
    problem, err, _ = decode_fp8_check(out[sl], ref, [(emulate_fp8_attention(*args, causal=causal), p_rms)])
    return problem, err


def run_cell(fa, Q, d, s, causal) -> dict:
    b = max(1, TOKENS // s)
    gen = torch.Generator(device="cuda").manual_seed(d * 1000 + s + causal)
    q = torch.randn(b, s, HQ, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, s, HKV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, s, HKV, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q8, k8, v8, qd, kd, vd = Q.quantize_qkv(q, k, v)
    row = dict(d=d, s=s, batch=b, hq=HQ, hkv=HKV, causal=causal, device=torch.cuda.get_device_name())
    f = flops(b, HQ, s, d, causal)
    impls = {
        "bf16": lambda: fa.flash_attn_func(q, k, v, causal=causal),
        "fp8": lambda: fa.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal),
    }
    for label, fn in impls.items():
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            if label == "bf16":
                g = HQ // HKV
                sl = (slice(0, 1), slice(None), slice(0, g))
                ref32 = refcheck.forward(q[sl], k[:1, :, :1], v[:1, :, :1], causal)
                ref16 = refcheck.forward(q[sl], k[:1, :, :1], v[:1, :, :1], causal, dtype=q.dtype)
                err, bar, problem = refcheck.check("out", out[sl], ref32, ref16)
                row.update(bf16_max_err=err, bf16_check_bar=bar)
            else:
                problem, err = fp8_check(out, q, k, v, q8, k8, v8, qd, kd, vd, causal)
                row["fp8_rms_err"] = err
        except Exception as exc:  # noqa: BLE001 - a cell an implementation cannot run is recorded
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if problem:
            row[f"{label}_error"] = "check failed: " + problem
            continue
        ms = time_fn(fn)
        row[f"{label}_ms"], row[f"{label}_tflops"] = ms, f / ms / 1e9
    if "fp8_ms" in row and "bf16_ms" in row:
        row["fp8_speedup_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_fwd: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    import flash_attn_4_sm120 as fa
    from flash_attn_4_sm120 import fp8_quant as Q

    rows = ceiling()
    for r in rows:
        print(json.dumps(r), flush=True)
    target = rows[-1]["target_speedup"]
    with torch.no_grad():
        for d, s, causal in CELLS:
            row = run_cell(fa, Q, d, s, causal)
            if "fp8_speedup_vs_bf16" in row:
                row["target_speedup"], row["meets_target"] = target, row["fp8_speedup_vs_bf16"] >= target
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = args.out or HERE / "results" / f"fp8_fwd_{gpu_tag()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
