"""How far a split-KV FP8 call may move from the unsplit one (CPU, tests/fp8_emulation.py): each split is emulated
on its own key range (P rounded to e4m3 against the split's own running max), the splits are combined with their
fp32 LSEs as kernels/combine.py does, and the result is compared with the unsplit emulation.

    python benchmarks/experiments/fp8_split_emulation.py   # -> benchmarks/results/fp8_split_emulation_cpu.jsonl

Recorded per cell: err_emu (unsplit emulation vs the fp32 reference of the unquantized bf16 inputs), err_split,
gap = RMS(split - unsplit), p_rms = RMS that P's rounding puts into the unsplit emulation (quantize_p True vs
False).  The GPU tests' split bar is 2 * p_rms (tests/test_fp8_split_gpu.py, tests/test_fp8_kvcache_gpu.py).
"""

import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]
from flash_attn_4_sm120.fp8_quant import quantize_qkv, quantize_query  # noqa: E402
from tests.fp8_emulation import emulate_fp8_attention, fa3_outlier_inputs, rms  # noqa: E402
from tests.reference import attention_ref  # noqa: E402

CELLS = ((700, 11), (1100, 7), (1100, 18), (2048, 4), (4096, 64), (8192, 8))
HQ, HKV, D = 32, 8, 128


def cell(sk, splits):
    q, k, v = fa3_outlier_inputs(1, 1, sk, HQ, HKV, D, seed=sk, dtype=torch.bfloat16)
    _, k8, v8, _, kd, vd = quantize_qkv(q, k, v)
    q8, qd = quantize_query(q, HKV)
    ref, _ = attention_ref(q, k, v)
    emu = emulate_fp8_attention(q8, k8, v8, qd, kd, vd, out_dtype=torch.float32)
    p_rms = rms(emu, emulate_fp8_attention(q8, k8, v8, qd, kd, vd, out_dtype=torch.float32, quantize_p=False))
    tiles = -(-sk // 64)
    per = -(-tiles // splits) * 64  # the kernel's rule: runs of ceil(tiles / splits) tiles
    g = HQ // HKV
    qf = q8.float() * qd.repeat_interleave(g, 1)[:, None, :, None]
    kf = (k8.float() * kd[:, None, :, None]).repeat_interleave(g, 2)
    s_all = torch.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(D)
    outs, lses = [], []
    for lo in range(0, sk, per):
        hi = min(lo + per, sk)
        outs.append(emulate_fp8_attention(q8, k8[:, lo:hi], v8[:, lo:hi], qd, kd, vd, out_dtype=torch.float32))
        lses.append(torch.logsumexp(s_all[..., lo:hi], -1))
    lse = torch.logsumexp(torch.stack(lses), 0)
    split = sum(torch.exp(l - lse).transpose(1, 2)[..., None] * o for o, l in zip(outs, lses))
    gap = rms(split, emu)
    return dict(sk=sk, splits=splits, used_splits=len(outs), hq=HQ, hkv=HKV, d=D, err_emu=rms(emu, ref),
                err_split=rms(split, ref), gap=gap, p_rms=p_rms, gap_over_2p_rms=gap / (2 * p_rms))


def main():
    rows = [{"kind": "meta", "machine": "cpu (emulation, torch fp32)", "torch": torch.__version__,
             "input": "FA3 outlier input in bf16, Sq 1, per-(batch, KV head) descales"}]
    for sk, splits in CELLS:
        rows.append(cell(sk, splits))
        print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "benchmarks" / "results" / "fp8_split_emulation_cpu.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
