"""FP8 forward accuracy on FlashAttention-3's outlier input, emulated on the CPU (tests/fp8_emulation.py).

RMS error of the output against an fp32 reference computed from the UNquantized inputs, for each quantization
variant of ``flash_attn_4_sm120.fp8_quant.quantize_qkv`` and a bf16 yardstick.  The GPU tests
(tests/test_fp8_gpu.py) derive their bars from these numbers.

    .venv/bin/python benchmarks/experiments/fp8_accuracy.py --out benchmarks/results/fp8_accuracy_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]

from flash_attn_4_sm120.fp8_quant import quantize_qkv  # noqa: E402
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, rms  # noqa: E402
from tests.reference import attention_ref  # noqa: E402

VARIANTS = {  # name -> (quantize_qkv kwargs, quantize P)
    "fp8_tensor": (dict(granularity="tensor"), True),
    "fp8_head": (dict(granularity="head"), True),
    "fp8_head_rot": (dict(granularity="head", rotate=True), True),
    "fp8_block_rot": (dict(granularity="block", rotate=True, block_size=128), True),
    "fp8_head_rot_p_fp32": (dict(granularity="head", rotate=True), False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for seed in range(args.seeds):
                q, k, v = fa3_outlier_inputs(1, args.seqlen, args.seqlen, 4, 2, d, seed=seed)
                ref, _ = attention_ref(q, k, v, causal=causal)
                bf, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal)
                cell = dict(d=d, causal=causal, seed=seed, seqlen=args.seqlen, hq=4, hkv=2,
                            ref_rms=float(ref.pow(2).mean().sqrt()), bf16_inputs_bf16_out=rms(bf, ref))
                for name, (kw, qp) in VARIANTS.items():
                    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v, **kw)
                    out = emulate_fp8_attention(q8, k8, v8, qd, kd, vd, causal=causal, quantize_p=qp,
                                                block_size=kw.get("block_size", 128))
                    cell[name] = rms(out, ref)
                print(json.dumps(cell), flush=True)
                rows.append(cell)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(kind="meta", machine="cpu (emulation, torch fp32)", torch=torch.__version__,
                input="FA3 outlier input: N(0,1), 0.1% entries N(0,10)", metric="RMS(out - fp32 ref of unquantized)",
                tile_n=64, kv_order="right_to_left", p_scale=16, out_dtype="bfloat16")
    args.out.write_text("\n".join(json.dumps(r) for r in [meta] + rows) + "\n")


if __name__ == "__main__":
    main()
