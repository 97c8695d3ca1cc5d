"""Device-side helpers shared by the kernels (CuTe-DSL; used at trace time only).

Everything here works on the register / shared-memory layouts of the SM80 ``mma.sync.m16n8k16`` atom, which
SM120/SM121 execute natively (HMMA.16816).  Accumulator fragments of that atom hold, per thread, 2x2 values:
mode 0 of the value layout walks the column pair (2 adjacent columns), mode 1 walks the row pair (rows g, g+8).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import T, dsl_user_op

from ..config import copy_threads_per_row

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def smem_layout_atom(dtype, k_dim: int):
    """Swizzled shared-memory atom for a (rows, k_dim) tile with k contiguous.

    Rows are split into 16-byte vectors; the XOR swizzle spreads the 8 rows an ``ldmatrix`` reads over distinct
    banks.  The widest atom that divides the row is used (128 B rows -> Swizzle<3,3,3>, 64 B -> <2,3,3>).
    """
    elem_bytes = dtype.width // 8
    row_bytes = k_dim * elem_bytes
    if row_bytes % 128 == 0:
        block_k, bits = 128 // elem_bytes, 3
    elif row_bytes % 64 == 0:
        block_k, bits = 64 // elem_bytes, 2
    else:
        block_k, bits = 32 // elem_bytes, 1
    return cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_ordered_layout((8, block_k), order=(1, 0))
    )


def gmem_tiled_copy(dtype, k_dim: int, num_threads: int, is_async: bool):
    """Tiled copy moving 16-byte vectors; threads tile a (rows, k_dim) block row-major."""
    vec = 128 // dtype.width
    threads_per_row = copy_threads_per_row(k_dim, dtype.width)
    if is_async:
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
    else:
        op = cute.nvgpu.CopyUniversalOp()
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    thr_layout = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """(a, b, ...) smem tensor viewed as (b, a, ...) without moving data."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def acc_mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an mma.sync accumulator ((2,2), MMA_M, MMA_N) as ((2, MMA_M), (2, MMA_N)): rows x columns."""
    lay = cute.make_layout(acc.layout.shape)
    mn = cute.make_layout(
        ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
        stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """Reinterpret a (4, MMA_M, MMA_N) accumulator of P as the A operand of the next k16 mma: ((4,2), MMA_M, MMA_N/2).

    Two adjacent n8 accumulator tiles hold exactly the values one thread owns of a 16-wide A fragment.
    """
    lay = cute.logical_divide(acc.layout, (None, None, 2))
    frg = cute.make_layout(
        ((lay.shape[0], lay.shape[2][0]), lay.shape[1], lay.shape[2][1]),
        stride=((lay.stride[0], lay.stride[2][0]), lay.stride[1], lay.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, frg)


@cute.jit
def quad_allreduce_max(x: Float32) -> Float32:
    """Max over the 4 lanes that share an accumulator row."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


@cute.jit
def quad_allreduce_sum(x: Float32) -> Float32:
    """Sum over the 4 lanes that share an accumulator row."""
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x


@cute.jit
def row_max(row: cute.TensorSSA, init: Float32) -> Float32:
    """Max of one accumulator row (this thread's part), as a 4-way tree to shorten the dependency chain."""
    vals = cute.make_rmem_tensor(row.shape, Float32)
    vals.store(row)
    n = cute.size(row.shape)
    if const_expr(n % 4 == 0):
        m = [vals[0], vals[1], vals[2], vals[3]]
        for i in cutlass.range_constexpr(4, n, 4):
            for j in cutlass.range_constexpr(4):
                m[j] = cute.arch.fmax(m[j], vals[i + j])
        res = cute.arch.fmax(cute.arch.fmax(m[0], m[1]), cute.arch.fmax(m[2], m[3]))
    else:
        res = vals[0]
        for i in cutlass.range_constexpr(1, n):
            res = cute.arch.fmax(res, vals[i])
    return cute.arch.fmax(res, init)


@cute.jit
def row_sum(row: cute.TensorSSA) -> Float32:
    """Sum of one accumulator row (this thread's part), as a 4-way tree."""
    vals = cute.make_rmem_tensor(row.shape, Float32)
    vals.store(row)
    n = cute.size(row.shape)
    if const_expr(n % 4 == 0):
        s = [vals[0], vals[1], vals[2], vals[3]]
        for i in cutlass.range_constexpr(4, n, 4):
            for j in cutlass.range_constexpr(4):
                s[j] = s[j] + vals[i + j]
        res = (s[0] + s[1]) + (s[2] + s[3])
    else:
        res = vals[0]
        for i in cutlass.range_constexpr(1, n):
            res = res + vals[i]
    return res


def ss_operands(tiled_mma, tidx, atom_A, atom_B, sA, sB) -> tuple:
    """The operands of one product streamed from shared memory for ``mma_ss`` on thread ``tidx``: (register
    fragments of A and B, their ldmatrix source partitions of ``sA`` / ``sB``, the two thread copies), in
    ``mma_ss``'s argument order; ``atom_A`` / ``atom_B``: the ldmatrix atoms (``ldmatrix_atom``, transposed where
    the view is)."""
    thr = tiled_mma.get_slice(tidx)
    copy_A = cute.make_tiled_copy_A(atom_A, tiled_mma).get_slice(tidx)
    copy_B = cute.make_tiled_copy_B(atom_B, tiled_mma).get_slice(tidx)
    return (thr.make_fragment_A(thr.partition_A(sA)), thr.make_fragment_B(thr.partition_B(sB)),
            copy_A.partition_S(sA), copy_B.partition_S(sB), copy_A, copy_B)


@cute.jit
def mma_ss(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, copy_A, copy_B, a_in_regs: cutlass.Constexpr[bool]):
    """acc += A @ B^T with operands streamed from smem by ldmatrix one k16 step ahead of the mma (A already in
    registers when ``a_in_regs``).  (Loading each step just in time instead spilled more at d_v = 256.)"""
    tCrA_view = copy_A.retile(tCrA)
    tCrB_view = copy_B.retile(tCrB)
    num_k = cute.size(tCsB.shape[2])
    if const_expr(not a_in_regs):
        cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            if const_expr(not a_in_regs):
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def mma_rs(tiled_mma, acc, tCrA, tCrB, tCsB, copy_B):
    """acc += A @ B^T with A already in registers (P) and B streamed from smem one k16 step ahead."""
    tCrB_view = copy_B.retile(tCrB)
    num_k = cute.size(tCrA.shape[2])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def mma_sr(tiled_mma, acc, tCrA, tCrB, tCsA, copy_A):
    """acc += A @ B^T with B already in registers (V in kernels/bwd_dkdv_vregs.py) and A streamed from smem one k16
    step ahead (``mma_rs`` with the operands' roles swapped)."""
    tCrA_view = copy_A.retile(tCrA)
    num_k = cute.size(tCrB.shape[2])
    cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)

def ldmatrix_atom(dtype, transpose: bool):
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)


def tiled_mma_16816(dtype, num_warps: int):
    """Warps stacked along M; the 16x8x16 atom repeats to cover the tile."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (num_warps, 1, 1),
        permutation_mnk=(num_warps * 16, 16, 16),
    )


__all__ = [
    "LOG2_E",
    "LN_2",
    "Int32",
    "smem_layout_atom",
    "gmem_tiled_copy",
    "transpose_view",
    "acc_mn_view",
    "acc_as_operand_a",
    "quad_allreduce_max",
    "quad_allreduce_sum",
    "row_max",
    "row_sum",
    "mma_ss",
    "mma_rs",
    "lt_abs_mask_f16x2",
    "red_add_f32x2",
    "ldmatrix_atom",
    "tiled_mma_16816",
]


@dsl_user_op
def lt_abs_mask_f16x2(a, b, *, loc=None, ip=None) -> Uint32:
    """Per 16-bit half: 0xFFFF where |half of ``a``| < half of ``b`` as fp16 values, else 0 (one HSET2, the
    absolute value an operand modifier: ``abs.f16x2`` + ``set.lt.u32.f16x2``, which ptxas folds; no .ftz, so
    subnormals compare as themselves).  With the sign bit ignored, patterns 0 ... 0x7BFF are finite and ordered as
    the unsigned integers; 0x7C00 is +inf and above are NaN, which compare false."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 abs_a;\nabs.f16x2 abs_a, $1;\nset.lt.u32.f16x2 $0, abs_a, $2;\n}", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def red_add_f32x2(addr, a, b, *, loc=None, ip=None) -> None:
    """Add (a, b) to the two fp32 values at global address ``addr`` (8-byte aligned): one vector reduction with no
    return value (``red.global.add.v2.f32``, an sm_90 instruction that SM120 has)."""
    llvm.inline_asm(
        None, [Int64(addr).ir_value(loc=loc, ip=ip), Float32(a).ir_value(loc=loc, ip=ip),
               Float32(b).ir_value(loc=loc, ip=ip)],
        "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class SmemRows:
    """Per-row values read from shared memory on use (``rows[r]`` = ``smem[base + offsets[r]]``, r a trace-time
    int): values that would otherwise hold a register per row across a loop body."""

    def __init__(self, smem, base, offsets):
        self.smem = smem
        self.base = base
        self.offsets = list(offsets)

    def __getitem__(self, r: int):
        return self.smem[self.base + self.offsets[r]]
