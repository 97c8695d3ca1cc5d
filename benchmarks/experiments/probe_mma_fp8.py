"""Register-only ceiling of mma.sync e4m3 (m16n8k32) beside bf16 (m16n8k16), fp32 accumulation, on this GPU.

Each warp runs CHAINS independent accumulator chains for ITERS steps on register operands (inline PTX), one A
register changed per chain and step by one integer op, so the tensor-core issue rate (plus, on the proxy, the
e4m3 unpacks of that register) is what counts.  On the H100 proxy ptxas lowers the e4m3 form to
e4m3->f16 unpacks plus two HMMA.16816 (benchmarks/results/fp8_gate_sm90a.jsonl): expect a ratio at or below 1
there; on SM120 it is QMMA.16832.

    .venv/bin/python benchmarks/experiments/probe_mma_fp8.py --out benchmarks/results/probe_mma_fp8_h100.jsonl
    CUTE_DSL_ARCH=sm_120a .venv/bin/python benchmarks/experiments/probe_mma_fp8.py --compile-only   # SASS census
"""


import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT), str(ROOT / "benchmarks")]

CHAINS = 8
ITERS = 4096
WARPS = 4


def build(kind: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from flash_attn_4_sm120.kernels.fp8_ptx import mma_e4m3_16832

    @dsl_user_op
    def mma_bf16_16816(a, b, c, *, loc=None, ip=None):
        args = ([Uint32(x).ir_value(loc=loc, ip=ip) for x in a] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in b]
                + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * 4), args,
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False,
            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), res, [i])) for i in range(4)]

    mma = mma_e4m3_16832 if kind == "e4m3" else mma_bf16_16816

    class Probe:
        @cute.jit
        def __call__(self, out: cute.Tensor, iters: Int32, stream):
            self.kernel(out, iters).launch(grid=(out.shape[0] // (32 * WARPS), 1, 1), block=(32 * WARPS, 1, 1),
                                           stream=stream)

        @cute.kernel
        def kernel(self, out: cute.Tensor, iters: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            seed = Uint32(tidx * 2654435761 + 12345)
            a = [seed, seed ^ Uint32(0x3C3C3C3C), seed ^ Uint32(0x1F1F1F1F), seed ^ Uint32(0x2A2A2A2A)]
            b = [seed ^ Uint32(0x0F0F0F0F), seed ^ Uint32(0x33333333)]
            acc = cute.make_rmem_tensor((CHAINS * 4,), Float32)
            x = Float32(tidx) * 1e-3
            for i in cutlass.range_constexpr(CHAINS * 4):  # distinct chains: none can be merged with another
                acc[i] = x + Float32(i)
            for it in cutlass.range(iters, unroll=2):
                for ch in cutlass.range_constexpr(CHAINS):
                    # one A register differs per chain and per step: no product is loop-invariant or shared
                    # (ptxas otherwise computes a loop-invariant A.B once and adds it with FADDs)
                    a_step = [a[0] ^ (Uint32(it) * Uint32(0x01010101) + Uint32(ch * 0x00010203)), a[1], a[2], a[3]]
                    res = mma(a_step, b, [acc[4 * ch + e] for e in range(4)])
                    for e in cutlass.range_constexpr(4):
                        acc[4 * ch + e] = res[e]
            s = Float32(0.0)
            for i in cutlass.range_constexpr(CHAINS * 4):
                s = s + acc[i]
            out[bidx * (32 * WARPS) + tidx] = s

    return Probe()


def compile_probe(kind):
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    fake = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    return cute.compile(build(kind), fake, Int32(1), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        options="--enable-tvm-ffi")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        import os
        import re
        import tempfile

        os.environ.setdefault("CUTE_DSL_KEEP", "cubin")
        os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp())
        from scripts.sass_check import disassemble

        for kind in ("bf16", "e4m3"):
            cubin = compile_probe(kind).__cubin__
            cubin = Path(cubin).read_bytes() if isinstance(cubin, str) else cubin
            sass = disassemble(cubin)
            ops = re.findall(r"\b([QHO]MMA\.[A-Z0-9_.]+|F2FP\.[A-Z0-9_.]+)", sass)
            print(kind, {op: ops.count(op) for op in sorted(set(ops))})
        return
    import torch

    from bench_fwd import append_jsonl, time_fn

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = sms * 8 * 32 * WARPS  # 8 CTAs of 4 warps per SM
    out = torch.empty(n, device="cuda", dtype=torch.float32)
    rows = []
    for kind, flop_per_mma in (("bf16", 2 * 16 * 8 * 16), ("e4m3", 2 * 16 * 8 * 32)):
        fn = compile_probe(kind)
        ms = time_fn(lambda: fn(out, ITERS))
        tflops = (n // 32) * ITERS * CHAINS * flop_per_mma / ms / 1e9
        rows.append(dict(device=torch.cuda.get_device_name(), kind=kind, ms=ms, tflops=tflops, warps=n // 32,
                         iters=ITERS, chains=CHAINS))
        print(rows[-1], flush=True)
    rows.append(dict(kind="ratio", fp8_over_bf16=rows[1]["tflops"] / rows[0]["tflops"]))
    print(rows[-1])
    append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
