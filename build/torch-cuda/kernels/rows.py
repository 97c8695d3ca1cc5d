"""Row-wise gmem <-> smem/register moves shared by every kernel (CuTe-DSL device code, trace time).

Rows are addressed through a callable ``row_of(i) -> (D,) gmem tensor`` built from ``SeqInfo.q_row`` /
``KV source.row`` (which clamp to the tensors), so a kernel never forms a row address by hand.
"""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

from . import cute_utils as cu


@cute.jit
def load_rows(row_of, sX: cute.Tensor, tiled_copy: cute.TiledCopy, tidx, first, limit,
              shape: cutlass.Constexpr, zero_fill: cutlass.Constexpr[bool]):
    """cp.async rows ``first + i`` (i < shape[0]) with ``first + i < limit`` into sX (a ``shape`` tile); the
    other rows are zeroed when ``zero_fill`` (they stay stale otherwise: the caller masks them)."""
    thr = tiled_copy.get_slice(tidx)
    cX = cute.make_identity_tensor(shape)
    tXsX, tXcX = thr.partition_D(sX), thr.partition_S(cX)
    vec = cute.size(tXsX.shape[0][0])
    for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
        idx = first + tXcX[0, m, 0][0]
        if idx < limit:
            g = cute.tiled_divide(row_of(idx), (vec,))
            for k in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
                cute.copy(tiled_copy, g[None, tXcX[0, 0, k][1] // vec], tXsX[None, m, k])
        else:
            if const_expr(zero_fill):
                tXsX[None, m, None].fill(0)


@cute.jit
def store_rows_from_smem(row_of, sX: cute.Tensor, tiled_copy: cute.TiledCopy, tidx, first, limit,
                         shape: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """16-byte coalesced stores of the rows ``first + i < limit`` of an smem tile (the forward's O epilogue)."""
    thr = tiled_copy.get_slice(tidx)
    cX = cute.make_identity_tensor(shape)
    tXsX, tXcX = thr.partition_S(sX), thr.partition_S(cX)
    tXrX = cute.make_rmem_tensor_like(tXsX, dtype)
    cute.autovec_copy(tXsX, tXrX)
    vec = cute.size(tXrX.shape[0][0])
    for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
        idx = first + tXcX[0, m, 0][0]
        if idx < limit:
            g = cute.tiled_divide(row_of(idx), (vec,))
            for k in cutlass.range_constexpr(cute.size(tXrX.shape[2])):
                cute.copy(tiled_copy, tXrX[None, m, k], g[None, tXcX[0, 0, k][1] // vec])


@cute.jit
def store_rows_from_acc(row_of, acc: cute.Tensor, thr_mma, first, limit, shape: cutlass.Constexpr,
                        dtype: cutlass.Constexpr):
    """Element-wise stores of an mma accumulator (rows ``first + i < limit``), converted to ``dtype``."""
    cX = cute.make_identity_tensor(shape)
    coords = cu.acc_mn_view(thr_mma.partition_C(cX))
    acc_mn = cu.acc_mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(coords, mode=[0])):
        idx = first + coords[r, 0][0]
        if idx < limit:
            g = row_of(idx)
            for c in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                g[coords[r, c][1]] = dtype(acc_mn[r, c])


@cute.jit
def store_row_pairs_from_acc(row_of, acc: cute.Tensor, thr_mma, first, limit, shape: cutlass.Constexpr,
                             dtype: cutlass.Constexpr):
    """Like ``store_rows_from_acc``, two adjacent columns per store (an mma.sync accumulator holds column pairs
    2j, 2j + 1 of each n8 tile): half the store instructions, one 8-byte store per pair for fp32."""
    cX = cute.make_identity_tensor(shape)
    coords = cu.acc_mn_view(thr_mma.partition_C(cX))
    acc_mn = cu.acc_mn_view(acc)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=2 * dtype.width)
    for r in cutlass.range_constexpr(cute.size(coords, mode=[0])):
        idx = first + coords[r, 0][0]
        if idx < limit:
            g = cute.tiled_divide(row_of(idx), (2,))
            for c in cutlass.range_constexpr(0, cute.size(coords, mode=[1]), 2):
                pair = cute.make_rmem_tensor(2, dtype)
                pair[0] = dtype(acc_mn[r, c])
                pair[1] = dtype(acc_mn[r, c + 1])
                cute.copy(atom, pair, g[None, coords[r, c][1] // 2])
