"""Inline-PTX building blocks of the FP8 forward (kernels/fwd_fp8.py), on 32-bit registers.

Fragment layouts of ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` (PTX ISA, "Matrix fragments for
mma.m16n8k32"), lane = 4 * g + t:
  A (16 x 32, 4 regs of 4 bytes): a0 = row g, cols 4t..4t+3; a1 = row g+8, same cols; a2 / a3 = the same rows,
      cols 16+4t..16+4t+3.  Byte i of a register is column 4t+i (+16).
  B (32 x 8, 2 regs): b0 = column g, rows (k) 4t..4t+3; b1 = column g, rows 16+4t..16+4t+3.
  C/D (16 x 8 fp32): c0, c1 = row g, cols 2t, 2t+1; c2, c3 = row g+8, same cols.
The instruction exists on sm_89, sm_90 (the H100 proxy) and sm_120a (as ``kind::f8f6f4``'s plain form).
"""

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(ret, args, text, cons, side_effects=False):
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


def _unpack(res, n, ty):
    return [llvm.extractvalue(ty, res, [i]) for i in range(n)]


@dsl_user_op
def mma_e4m3_16832(a, b, c, *, loc=None, ip=None):
    """c (4 fp32) + A (4 regs) x B (2 regs) -> 4 fp32 (one mma.sync m16n8k32 e4m3 x e4m3 -> f32)."""
    args = ([Uint32(x).ir_value(loc=loc, ip=ip) for x in a] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in b]
            + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
    res = _asm(llvm.StructType.get_literal([T.f32()] * 4), args,
               "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
               "{$8, $9}, {$10, $11, $12, $13};",
               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    return [Float32(x) for x in _unpack(res, 4, T.f32())]


@dsl_user_op
def transpose_bytes_4x4(w, *, loc=None, ip=None):
    """4 words (rows r = 0..3, bytes = columns) -> 4 words (columns c = 0..3, byte r = row r): 8 byte permutes."""
    args = [Uint32(x).ir_value(loc=loc, ip=ip) for x in w]
    res = _asm(llvm.StructType.get_literal([T.i32()] * 4), args,
               "{\n.reg .b32 lo01, hi01, lo23, hi23;\n"
               "prmt.b32 lo01, $4, $5, 0x5140;\nprmt.b32 hi01, $4, $5, 0x7362;\n"
               "prmt.b32 lo23, $6, $7, 0x5140;\nprmt.b32 hi23, $6, $7, 0x7362;\n"
               "prmt.b32 $0, lo01, lo23, 0x5410;\nprmt.b32 $1, lo01, lo23, 0x7632;\n"
               "prmt.b32 $2, hi01, hi23, 0x5410;\nprmt.b32 $3, hi01, hi23, 0x7632;\n}",
               "=r,=r,=r,=r,r,r,r,r")
    return [Uint32(x) for x in _unpack(res, 4, T.i32())]


@dsl_user_op
def cvt_e4m3x4(x0, x1, x2, x3, *, loc=None, ip=None) -> Uint32:
    """4 fp32 -> 4 e4m3 bytes (x0 in byte 0), round to nearest even, saturating to +-448."""
    args = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)]
    return Uint32(_asm(T.i32(), args,
                       "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                       "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
                       "=r,f,f,f,f"))


@dsl_user_op
def cvt_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    args = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    return Uint32(_asm(T.i32(), args, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"))


@dsl_user_op
def cvt_f16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    args = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    return Uint32(_asm(T.i32(), args, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f"))


@dsl_user_op
def ld_global_nc_u32(addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.b32 $0, [$1];", "=r,l"))


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip)], "ld.shared.b32 $0, [$1];", "=r,r",
                       side_effects=True))


@dsl_user_op
def st_global_v4(addr, r, *, loc=None, ip=None) -> None:
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in r]
    _asm(None, args, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effects=True)


@dsl_user_op
def st_global_v4_f32(addr, x, *, loc=None, ip=None) -> None:
    """4 fp32 -> 16 bytes of global memory (the split-KV partial output)."""
    args = [Int64(addr).ir_value(loc=loc, ip=ip)] + [Float32(v).ir_value(loc=loc, ip=ip) for v in x]
    _asm(None, args, "st.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", side_effects=True)


@dsl_user_op
def cp_async_16(smem_addr, gmem_addr, src_bytes, *, loc=None, ip=None) -> None:
    """16 bytes global -> shared, bypassing L1; bytes past ``src_bytes`` (0 or 16) are zero-filled."""
    args = [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
            Int32(src_bytes).ir_value(loc=loc, ip=ip)]
    _asm(None, args, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", side_effects=True)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    _asm(None, [], "cp.async.commit_group;", "", side_effects=True)


@dsl_user_op
def cp_async_wait(n: int, *, loc=None, ip=None) -> None:
    _asm(None, [], f"cp.async.wait_group {int(n)};", "", side_effects=True)


@dsl_user_op
def exp2_approx(x, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f"))


@dsl_user_op
def log2_approx(x, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "lg2.approx.ftz.f32 $0, $1;", "=f,f"))


@dsl_user_op
def ld_global_v4_u32(addr, *, loc=None, ip=None):
    """16 bytes of global memory (read-only for the kernel's lifetime) -> 4 registers."""
    res = _asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
               "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l")
    return [Uint32(x) for x in _unpack(res, 4, T.i32())]


@dsl_user_op
def unpack_x2_f32(w, fp16: bool, *, loc=None, ip=None):
    """One register of two 16-bit floats (bf16, or fp16 with ``fp16``) -> (low, high) as fp32 (exact)."""
    if fp16:
        text = "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n}"
    else:  # a bf16 is the top half of its fp32
        text = ("{\n.reg .b32 a, b;\nshl.b32 a, $2, 16;\nand.b32 b, $2, 0xffff0000;\nmov.b32 $0, a;\n"
                "mov.b32 $1, b;\n}")
    res = _asm(llvm.StructType.get_literal([T.f32()] * 2), [Uint32(w).ir_value(loc=loc, ip=ip)], text, "=f,=f,r")
    return [Float32(x) for x in _unpack(res, 2, T.f32())]


@dsl_user_op
def st_shared_v2(addr, r, *, loc=None, ip=None) -> None:
    args = [Int32(addr).ir_value(loc=loc, ip=ip)] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in r]
    _asm(None, args, "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r", side_effects=True)
