"""FP8 KV-cache accuracy with a bf16 query, emulated on the CPU (tests/fp8_emulation.py): what
tests/test_fp8_kvcache_gpu.py's bars sit on.

FlashAttention-3's outlier input in bf16 (q, k, v), decode-shaped (Hq 32 / Hkv 8, d128, 4096 keys, q_len 1 and 16
causal); the cache is K/V quantized per (batch, KV head) (``fp8_quant.quantize_qkv``'s descales), the query
quantized as the kernel's bf16/fp16-query form does (``tests/fp8_emulation.quantize_rows``: one scale per
(query row, head), what ``flash_attn_with_kvcache`` runs), as the host did before it (``fp8_quant.quantize_query``:
per (batch, KV head); still the fallback of a varlen call whose out_dtype differs from q's) or, for comparison,
with one scale for the whole query.  RMS error of the output against the fp32 reference of the
UNquantized bf16 inputs, beside the bf16 cache's (PyTorch in bf16) and the reference's own RMS.

    .venv/bin/python benchmarks/experiments/fp8_kvcache_accuracy.py --out benchmarks/results/fp8_kvcache_accuracy_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]

from flash_attn_4_sm120.fp8_quant import quantize_qkv, quantize_query  # noqa: E402
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, quantize_rows, rms  # noqa: E402
from tests.reference import attention_ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for sq in (1, 16):
        causal = sq > 1
        for seed in range(args.seeds):
            q, k, v = fa3_outlier_inputs(2, sq, args.seqlen, 32, 8, 128, seed=seed, dtype=torch.bfloat16)
            ref, _ = attention_ref(q, k, v, causal=causal)
            bf, _ = attention_ref(q, k, v, causal=causal, upcast=False)
            _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
            cell = dict(sq=sq, causal=causal, seed=seed, seqlen=args.seqlen, hq=32, hkv=8, d=128,
                        ref_rms=float(ref.float().pow(2).mean().sqrt()), bf16_cache=rms(bf, ref))
            qr8, qrd = quantize_rows(q)
            cell["fp8_cache_q_per_row"] = rms(emulate_fp8_attention(qr8, k8, v8, qrd, kd, vd, causal=causal,
                                                                    q_rows=True), ref)
            q8, qd = quantize_query(q, 8)
            cell["fp8_cache_q_per_kv_head"] = rms(emulate_fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal), ref)
            qt8, _, _, qtd, _, _ = quantize_qkv(q, k, v, granularity="tensor")
            cell["fp8_cache_q_per_tensor"] = rms(emulate_fp8_attention(qt8, k8, v8, qtd, kd, vd, causal=causal),
                                                 ref)
            print(json.dumps(cell), flush=True)
            rows.append(cell)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(kind="meta", machine="cpu (emulation, torch fp32)", torch=torch.__version__,
                input="FA3 outlier input in bf16: N(0,1), 0.1% entries N(0,10)",
                metric="RMS(out - fp32 ref of the unquantized bf16 inputs)", out_dtype="bfloat16")
    with args.out.open("w") as f:
        for r in [meta] + rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
