"""Pieces shared by the forward kernels (CuTe-DSL device code): sequence bounds, per-row addressing with packed
GQA, Q load, the KV-block schedule, and the epilogue (softmax finalisation, LSE and O stores).

Subclasses provide ``compute_sync()`` (a barrier over the threads that own accumulators) and the main loop.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import cute_utils as cu
from .config import FwdKernelConfig, fwd_smem_bytes
from .masking import apply_mask
from .softmax import online_softmax_step, softmax_finalize

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


class FwdKernelBase:
    def __init__(self, cfg: FwdKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.d = cfg.head_dim
        self.dv = cfg.head_dim_v
        t = cfg.tile
        self.tile_m, self.tile_n = t.tile_m, t.tile_n
        self.num_warps, self.num_stages, self.q_in_regs = t.num_warps, t.num_stages, t.q_in_regs
        self.num_mma_threads = t.num_warps * 32
        self.smem_bytes = fwd_smem_bytes(self.d, self.dv, t)

    def compute_sync(self):
        raise NotImplementedError

    @cute.jit
    def seq_bounds(self, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, batch):
        """(offset_q, offset_k, seqlen_q, seqlen_k) of batch entry ``batch`` (static lengths: non-varlen)."""
        cfg = self.cfg
        offset_q = Int32(0)
        offset_k = Int32(0)
        if const_expr(cfg.varlen_q):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        else:
            seqlen_q = seqlen_q_static
        if const_expr(cfg.varlen_k):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        else:
            seqlen_k = seqlen_k_static
        if const_expr(cfg.seqused_q):
            seqlen_q = mSeqUsedQ[batch]
        if const_expr(cfg.seqused_k):
            seqlen_k = mSeqUsedK[batch]
        return offset_q, offset_k, seqlen_q, seqlen_k

    @cute.jit
    def row_tensor(self, mX: cute.Tensor, varlen: cutlass.Constexpr[bool], batch, offset, pos, head):
        """The (D,) gmem row of token ``pos`` of ``head`` in this batch entry."""
        if const_expr(varlen):
            return mX[offset + pos, head, None]
        else:
            return mX[batch, pos, head, None]

    @cute.jit
    def load_q(self, mQ, sQ, copy_q, tidx, batch, head_group, m_block, offset_q, pack, num_rows):
        """cp.async the Q tile, row by row (a tile row is (position, head-in-group) under packed GQA)."""
        thr = copy_q.get_slice(tidx)
        cQ = cute.make_identity_tensor((self.tile_m, self.d))
        tQsQ, tQcQ = thr.partition_D(sQ), thr.partition_S(cQ)
        vec = cute.size(tQsQ.shape[0][0])
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            row = m_block * self.tile_m + tQcQ[0, m, 0][0]
            if row < num_rows:
                pos = row // pack
                head = head_group * pack + (row - pos * pack)
                gq = cute.tiled_divide(self.row_tensor(mQ, self.cfg.varlen_q, batch, offset_q, pos, head), (vec,))
                for k in cutlass.range_constexpr(cute.size(tQsQ.shape[2])):
                    cute.copy(copy_q, gq[None, tQcQ[0, 0, k][1] // vec], tQsQ[None, m, k])

    @cute.jit
    def row_coords(self, tiled_mma, tidx, m_block, pack):
        """This thread's accumulator coordinates (and thread 0's, for compile-time column offsets) and the query
        position of each of its rows."""
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = cu.acc_mn_view(tiled_mma.get_slice(tidx).partition_C(cS))
        t0ScS_mn = cu.acc_mn_view(tiled_mma.get_slice(0).partition_C(cS))
        num_rows = cute.size(tScS_mn, mode=[0])
        row_qpos = cute.make_rmem_tensor(num_rows, Int32)
        for r in cutlass.range_constexpr(num_rows):
            row_qpos[r] = (m_block * self.tile_m + tScS_mn[r, 0][0]) // pack
        return tScS_mn, t0ScS_mn, row_qpos

    @cute.jit
    def run_schedule(self, step, state, n_first, count_a, count_b, count_c):
        """Visit KV blocks n_first, n_first-1, ... in the phases of masking.kv_block_plan.  ``step`` processes
        one block and returns the updated pipeline state."""
        cfg = self.cfg
        state = step(n_first, state, is_first=True, mask_seqlen=True, mask_right=cfg.windowed,
                     mask_left=cfg.windowed)
        if const_expr(cfg.windowed):
            for i in cutlass.range(count_a, unroll=1):
                state = step(n_first - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=True,
                             mask_left=True)
        start_b = n_first - count_a
        for i in cutlass.range(count_b, unroll=1):
            state = step(start_b - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=False,
                         mask_left=False)
        if const_expr(cfg.windowed):
            start_c = start_b - count_b
            for i in cutlass.range(count_c, unroll=1):
                state = step(start_c - 1 - i, state, is_first=False, mask_seqlen=False, mask_right=False,
                             mask_left=True)
        return state

    @cute.jit
    def scores_to_p(
        self, acc_S, acc_O, state_max, state_sum, scale_log2, softcap_prescale, tScS_mn, t0ScS_mn, row_qpos,
        n_block, seqlen_k, diag, window_left, window_right,
        is_first: cutlass.Constexpr[bool], mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool],
    ):
        """S tile -> softcap -> boundary masks -> online softmax (rescales acc_O) -> P in the input dtype, returned
        as the A operand of the P V mma."""
        if const_expr(self.cfg.has_softcap):
            acc_S.store(cute.math.tanh(acc_S.load() * softcap_prescale, fastmath=True))
        if const_expr(mask_seqlen or mask_right or mask_left):
            apply_mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, seqlen_k, diag, window_left, window_right,
                       self.tile_n, mask_seqlen, mask_right, mask_left)
        online_softmax_step(acc_S, acc_O, state_max, state_sum, scale_log2, is_first)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        return cu.acc_as_operand_a(rP)

    @cute.jit
    def epilogue(self, acc_O, state_max, state_sum, scale_log2, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx,
                 tScS_mn, batch, head_group, m_block, offset_q, pack, num_rows):
        cfg = self.cfg
        num_my_rows = cute.size(state_max)
        lse = cute.make_rmem_tensor(num_my_rows, Float32)
        sink = cute.make_rmem_tensor(num_my_rows, Float32)
        if const_expr(cfg.has_sink):
            for r in cutlass.range_constexpr(num_my_rows):
                row = m_block * self.tile_m + tScS_mn[r, 0][0]
                sink[r] = Float32(mSink[head_group * pack + row % pack])
        softmax_finalize(acc_O, state_max, state_sum, scale_log2, lse, sink, cfg.has_sink)
        self.store_lse(mLSE, lse, tScS_mn, batch, head_group, m_block, offset_q, pack, num_rows)
        self.compute_sync()  # every warp is done reading Q/K/V smem before O overwrites it
        self.store_o(mO, acc_O, sO, tiled_mma, copy_o, tidx, batch, head_group, m_block, offset_q, pack, num_rows)

    @cute.jit
    def store_lse(self, mLSE, lse, tScS_mn, batch, head_group, m_block, offset_q, pack, num_rows):
        if tScS_mn[0, 0][1] == 0:  # one lane of each quad owns the row
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tScS_mn[r, 0][0]
                if row < num_rows:
                    pos = row // pack
                    head = head_group * pack + (row - pos * pack)
                    if const_expr(self.cfg.varlen_q):
                        mLSE[head, offset_q + pos] = lse[r]
                    else:
                        mLSE[batch, head, pos] = lse[r]

    @cute.jit
    def store_o(self, mO, acc_O, sO, tiled_mma, copy_o, tidx, batch, head_group, m_block, offset_q, pack,
                num_rows):
        """acc_O -> bf16/fp16 -> smem (swizzled) -> 16-byte coalesced row stores."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype)
        st_thr = cute.make_tiled_copy_C(st_atom, tiled_mma).get_slice(tidx)
        cute.copy(st_atom, st_thr.retile(rO), st_thr.partition_D(sO))
        self.compute_sync()
        thr = copy_o.get_slice(tidx)
        cO = cute.make_identity_tensor((self.tile_m, self.dv))
        tOsO, tOcO = thr.partition_S(sO), thr.partition_S(cO)
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        vec = cute.size(tOrO.shape[0][0])
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            row = m_block * self.tile_m + tOcO[0, m, 0][0]
            if row < num_rows:
                pos = row // pack
                head = head_group * pack + (row - pos * pack)
                go = cute.tiled_divide(self.row_tensor(mO, self.cfg.varlen_q, batch, offset_q, pos, head), (vec,))
                for k in cutlass.range_constexpr(cute.size(tOrO.shape[2])):
                    cute.copy(copy_o, tOrO[None, m, k], go[None, tOcO[0, 0, k][1] // vec])
