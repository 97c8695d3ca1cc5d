"""Backward preprocess: D = rowsum(dO * O) (- dLSE), the per-row term of dS = P * (dP - D).

Layouts (the host views a varlen call, (total_q, H, Dv) and (H, total_q), as batch 1):
    dout, out  (B, S, H, Dv)  bf16/fp16, Dv contiguous, rows 16-byte aligned, other strides arbitrary
    dpsum      (B, H, S)      fp32, S contiguous (the LSE layout the backward kernels read)
    dlse       (B, H, S)      fp32, any strides (optional: config.has_dlse)

Work split: ``tpr`` threads (a power of two <= 32, config.bwd_pre_threads_per_row) own one row; each loads
``ceil(Dv / (8 * tpr))`` 16-byte vectors of dO and of O (when the row's vectors are not a power of two its last
lanes reload the last vector, a cached line, and drop their sum).  Rows are numbered in dpsum's order (s fastest), so a warp's groups store consecutive floats; each group
owns ``ROWS`` rows ``groups`` apart and issues all their loads before it multiplies.  Products and sums are fp32;
a row's lanes reduce with butterfly shuffles.  Rows past the end are clamped to the last row (every lane joins the
shuffles) and not stored.  No shared memory, no atomics.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import BWD_PRE_ARGS
from ..config_bwd import (BWD_PRE_ROWS_PER_GROUP, BWD_PRE_THREADS, BWD_PRE_VEC, BwdPreKernelConfig,
                      bwd_pre_threads_per_row)

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


class FlashBwdPreprocess:
    ARGS = BWD_PRE_ARGS
    ROWS = BWD_PRE_ROWS_PER_GROUP

    def __init__(self, cfg: BwdPreKernelConfig):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.vectors = cfg.head_dim_v // BWD_PRE_VEC  # 16-byte vectors per row
        self.tpr = bwd_pre_threads_per_row(cfg.head_dim_v)
        self.vecs = -(-self.vectors // self.tpr)  # vectors per thread per row
        self.num_threads = BWD_PRE_THREADS
        self.groups = BWD_PRE_THREADS // self.tpr
        self.rows_per_cta = self.groups * self.ROWS
        self.launch_smem_bytes = 0

    @cute.jit
    def __call__(self, dout: cute.Tensor, out: cute.Tensor, dpsum: cute.Tensor, dlse: cute.Tensor | None,
                 num_rows: Int32, stream):
        self.kernel(dout, out, dpsum, dlse, num_rows).launch(
            grid=((num_rows + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1), block=(self.num_threads, 1, 1),
            smem=0, stream=stream,
        )

    @cute.kernel
    def kernel(self, mdO: cute.Tensor, mO: cute.Tensor, mD: cute.Tensor, mdLSE: cute.Tensor | None,
               num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tpr, vec = self.tpr, BWD_PRE_VEC
        lane = tidx % tpr
        first = bidx * self.rows_per_cta + tidx // tpr
        seqlen, num_heads = mO.shape[1], mO.shape[2]

        frag_do = cute.make_rmem_tensor((vec, self.vecs, self.ROWS), self.dtype)
        frag_o = cute.make_rmem_tensor((vec, self.vecs, self.ROWS), self.dtype)
        for u in cutlass.range_constexpr(self.ROWS):  # every load unconditional: all of them in flight at once
            batch, head, pos = self.row_coords(first + u * self.groups, num_rows, seqlen, num_heads)
            g_do = cute.tiled_divide(mdO[batch, pos, head, None], (vec,))
            g_o = cute.tiled_divide(mO[batch, pos, head, None], (vec,))
            for j in cutlass.range_constexpr(self.vecs):
                idx = lane + j * tpr
                if const_expr(self.ragged(j)):  # idle lanes reload the row's last vector; their sum is dropped
                    idx = cutlass.min(idx, self.vectors - 1)
                cute.autovec_copy(g_do[None, idx], frag_do[None, j, u])
                cute.autovec_copy(g_o[None, idx], frag_o[None, j, u])

        for u in cutlass.range_constexpr(self.ROWS):
            total = Float32(0.0)
            for j in cutlass.range_constexpr(self.vecs):
                prod = frag_do[None, j, u].load().to(Float32) * frag_o[None, j, u].load().to(Float32)
                part = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if const_expr(self.ragged(j)):
                    part = part if lane + j * tpr < self.vectors else Float32(0.0)  # a select: 0 * inf is NaN
                total = total + part
            total = self.group_sum(total)
            row = first + u * self.groups
            if row < num_rows and lane == 0:
                batch, head, pos = self.row_coords(row, num_rows, seqlen, num_heads)
                if const_expr(self.cfg.has_dlse):
                    total = total - mdLSE[batch, head, pos]
                mD[batch, head, pos] = total

    def ragged(self, j: int) -> bool:
        """Whether some lanes of the row have no vector ``j`` (trace-time)."""
        return (j + 1) * self.tpr > self.vectors

    @cute.jit
    def row_coords(self, row: Int32, num_rows: Int32, seqlen: Int32, num_heads: Int32):
        """(batch, head, position) of a row in dpsum's order, the row clamped to the last one."""
        row = cutlass.min(row, num_rows - 1)
        bh = row // seqlen
        return bh // num_heads, bh % num_heads, row % seqlen

    @cute.jit
    def group_sum(self, x: Float32) -> Float32:
        """Sum over the ``tpr`` lanes of one row (butterfly shuffles inside the aligned lane group)."""
        for k in cutlass.range_constexpr(self.tpr.bit_length() - 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=self.tpr >> (k + 1))
        return x
