"""dQ kernel of the backward (Q-stationary, atomic-free).

One CTA owns ``tile_m`` query rows of one head and walks the visible key blocks in a fixed ascending order,
recomputing S = Q K^T, P, dP = dO V^T and dS = P (dP - D) like the main backward kernel, and accumulates
dQ = dS K in registers (dS goes straight from the accumulator into the A operand, like P in the forward).  No
atomics: the summation order is fixed, so dQ is bitwise reproducible.  dK/dV come from bwd_kernel.py (also
atomic-free).  It recomputes S and dP once more, yet the pair beat dQ-by-atomics on the H100 proxy.

Layouts as bwd_kernel.py; dq is written in q's dtype (scaled by the softmax scale), rows past the sequence are
left to the host's zero fill.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import cute_utils as cu
from .config import BwdKernelConfig
from .fwd_common import DTYPES
from .masking import apply_mask, kv_block_plan


class FlashBwdDqSm80:
    def __init__(self, cfg: BwdKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n, self.num_warps = cfg.tile_m, cfg.tile_n, cfg.num_warps
        self.num_threads = cfg.num_warps * 32

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
        mDpsum: cute.Tensor, mdQ: cute.Tensor, mPdPsum: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None, mSeqUsedK: cute.Tensor | None, scale_log2: Float32,
        softcap_prescale: Float32, softmax_scale: Float32, window_left: Int32, window_right: Int32,
        qheads_per_kvhead: Int32, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32, stream,
    ):
        dt = self.dtype
        a = cu.smem_layout_atom
        sQ_l = cute.tile_to_shape(a(dt, self.d), (self.tile_m, self.d), (0, 1))
        sdO_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_m, self.dv), (0, 1))
        sK_l = cute.tile_to_shape(a(dt, self.d), (self.tile_n, self.d), (0, 1))
        sV_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_n, self.dv), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_l)], 1024]

        self.launch_smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, scale_log2,
            softcap_prescale, softmax_scale, window_left, window_right, qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l,
            cu.tiled_mma_16816(dt, self.num_warps), cu.gmem_tiled_copy(dt, self.d, self.num_threads, is_async=True),
            cu.gmem_tiled_copy(dt, self.dv, self.num_threads, is_async=True), SharedStorage,
        ).launch(
            grid=(num_m_blocks, num_heads, num_batch), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream,
        )

    @cute.jit
    def row(self, mX, varlen: cutlass.Constexpr[bool], batch, offset, pos, head):
        if const_expr(varlen):
            return mX[offset + pos, head, None]
        else:
            return mX[batch, pos, head, None]

    @cute.jit
    def load_rows(self, mX, sX, tiled_copy, tidx, varlen: cutlass.Constexpr[bool], batch, offset, first_pos,
                  head, limit, k_dim: cutlass.Constexpr[int], rows: cutlass.Constexpr[int]):
        thr = tiled_copy.get_slice(tidx)
        cX = cute.make_identity_tensor((rows, k_dim))
        tXsX, tXcX = thr.partition_D(sX), thr.partition_S(cX)
        vec = cute.size(tXsX.shape[0][0])
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            pos = first_pos + tXcX[0, m, 0][0]
            if pos < limit:
                g = cute.tiled_divide(self.row(mX, varlen, batch, offset, pos, head), (vec,))
                for k in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
                    cute.copy(tiled_copy, g[None, tXcX[0, 0, k][1] // vec], tXsX[None, m, k])
            else:
                tXsX[None, m, None].fill(0)

    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
        scale_log2: Float32, softcap_prescale: Float32, softmax_scale: Float32, window_left: Int32,
        window_right: Int32, qheads_per_kvhead: Int32, sQ_l: cute.ComposedLayout, sdO_l: cute.ComposedLayout,
        sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout, tiled_mma: cute.TiledMma, copy_d: cute.TiledCopy,
        copy_dv: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        offset_q = Int32(0)
        offset_k = Int32(0)
        if const_expr(cfg.varlen_q):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
        else:
            seqlen_q = mQ.shape[1]
        if const_expr(cfg.varlen_k):
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        else:
            seqlen_k = mK.shape[1]
        if const_expr(cfg.seqused_q):
            seqlen_q = mSeqUsedQ[batch]
        if const_expr(cfg.seqused_k):
            seqlen_k = mSeqUsedK[batch]
        if m_block * self.tile_m < seqlen_q:
            self.process(mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, scale_log2, softcap_prescale, softmax_scale,
                         window_left, window_right, qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, tiled_mma, copy_d,
                         copy_dv, SharedStorage, tidx, m_block, head, batch, offset_q, offset_k, seqlen_q, seqlen_k)

    @cute.jit
    def process(self, mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, scale_log2, softcap_prescale, softmax_scale, window_left,
                window_right, qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, tiled_mma, copy_d, copy_dv,
                SharedStorage: cutlass.Constexpr, tidx, m_block, head, batch, offset_q, offset_k, seqlen_q, seqlen_k):
        cfg = self.cfg
        dt = self.dtype
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_l), storage.sdO.get_tensor(sdO_l)
        sK, sV = storage.sK.get_tensor(sK_l), storage.sV.get_tensor(sV_l)
        sKt = cu.transpose_view(sK)
        kv_head = head // qheads_per_kvhead
        first_q = m_block * self.tile_m
        self.load_rows(mQ, sQ, copy_d, tidx, cfg.varlen_q, batch, offset_q, first_q, head, seqlen_q, self.d,
                       self.tile_m)
        self.load_rows(mdO, sdO, copy_dv, tidx, cfg.varlen_q, batch, offset_q, first_q, head, seqlen_q, self.dv,
                       self.tile_m)
        cute.arch.cp_async_commit_group()

        ld = cu.ldmatrix_atom
        thr = tiled_mma.get_slice(tidx)
        cpA = cute.make_tiled_copy_A(ld(dt, False), tiled_mma).get_slice(tidx)
        cpB = cute.make_tiled_copy_B(ld(dt, False), tiled_mma).get_slice(tidx)
        cpBt = cute.make_tiled_copy_B(ld(dt, True), tiled_mma).get_slice(tidx)
        tSrQ, tSrK = thr.make_fragment_A(thr.partition_A(sQ)), thr.make_fragment_B(thr.partition_B(sK))
        tPrdO, tPrV = thr.make_fragment_A(thr.partition_A(sdO)), thr.make_fragment_B(thr.partition_B(sV))
        tQrKt = thr.make_fragment_B(thr.partition_B(sKt))
        tSsQ, tSsK, tPsdO, tPsV = cpA.partition_S(sQ), cpB.partition_S(sK), cpA.partition_S(sdO), cpB.partition_S(sV)
        tQsKt = cpBt.partition_S(sKt)
        acc_shape_s = thr.partition_shape_C((self.tile_m, self.tile_n))
        acc_dQ = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_m, self.d)), Float32)
        acc_dQ.fill(0.0)

        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS_mn = cu.acc_mn_view(thr.partition_C(cS))
        t0ScS_mn = cu.acc_mn_view(tiled_mma.get_slice(0).partition_C(cS))
        num_rows = cute.size(tScS_mn, mode=[0])
        row_qpos = cute.make_rmem_tensor(num_rows, Int32)
        lse_log2 = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)
        pdp = cute.make_rmem_tensor(num_rows, Float32)  # sum_j P_ij dP_ij in fp32: D without O's rounding
        pdp.fill(0.0)
        for r in cutlass.range_constexpr(num_rows):
            pos = first_q + tScS_mn[r, 0][0]
            row_qpos[r] = pos
            lse_log2[r] = Float32.inf
            dpsum[r] = 0.0
            if pos < seqlen_q:
                if const_expr(cfg.varlen_q):
                    lse_log2[r] = mLSE[head, offset_q + pos] * cu.LOG2_E
                    dpsum[r] = mDpsum[head, offset_q + pos]
                else:
                    lse_log2[r] = mLSE[batch, head, pos] * cu.LOG2_E
                    dpsum[r] = mDpsum[batch, head, pos]
                lse_log2[r] = Float32.inf if lse_log2[r] == -Float32.inf else lse_log2[r]

        n_min, n_max, _, _, _ = kv_block_plan(seqlen_q, seqlen_k, m_block, Int32(1), window_left, window_right,
                                              self.tile_m, self.tile_n, cfg.windowed)
        for n_block in cutlass.range(n_min, n_max, unroll=1):
            first_key = n_block * self.tile_n
            self.load_rows(mK, sK, copy_d, tidx, cfg.varlen_k, batch, offset_k, first_key, kv_head, seqlen_k,
                           self.d, self.tile_n)
            self.load_rows(mV, sV, copy_dv, tidx, cfg.varlen_k, batch, offset_k, first_key, kv_head, seqlen_k,
                           self.dv, self.tile_n)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            acc_S = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_S.fill(0.0)
            cu.mma_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK, cpA, cpB, False)
            if const_expr(cfg.has_softcap):
                acc_S.store(cute.math.tanh(acc_S.load() * softcap_prescale, fastmath=True))
            apply_mask(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, seqlen_k, seqlen_k - seqlen_q, window_left,
                       window_right, self.tile_n, True, cfg.windowed, cfg.windowed)
            acc_dP = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_dP.fill(0.0)
            cu.mma_ss(tiled_mma, acc_dP, tPrdO, tPrV, tPsdO, tPsV, cpA, cpB, False)
            s_mn, dp_mn = cu.acc_mn_view(acc_S), cu.acc_mn_view(acc_dP)
            for r in cutlass.range_constexpr(num_rows):
                for c in cutlass.range_constexpr(cute.size(dp_mn, mode=[1])):
                    p = cute.math.exp2(s_mn[r, c] * scale_log2 - lse_log2[r], fastmath=True)
                    pdp[r] = pdp[r] + p * dp_mn[r, c]
                    ds = p * (dp_mn[r, c] - dpsum[r])
                    if const_expr(cfg.has_softcap):
                        t = s_mn[r, c]
                        ds = ds * cute.arch.fmax(1.0 - t * t, 0.0)
                    dp_mn[r, c] = ds
            rdS = cute.make_rmem_tensor_like(acc_dP, dt)
            rdS.store(acc_dP.load().to(dt))
            cu.mma_rs(tiled_mma, acc_dQ, cu.acc_as_operand_a(rdS), tQrKt, tQsKt, cpBt)
            cute.arch.barrier()  # every warp is done with K/V before the next block overwrites them

        # per-row sum of P * dP (the learnable-sink gradient uses it: exact D, not rowsum(dO * bf16 O))
        for r in cutlass.range_constexpr(num_rows):
            total = cu.quad_allreduce_sum(pdp[r])
            if tScS_mn[0, 0][1] == 0 and row_qpos[r] < seqlen_q:
                if const_expr(cfg.varlen_q):
                    mPdPsum[head, offset_q + row_qpos[r]] = total
                else:
                    mPdPsum[batch, head, row_qpos[r]] = total

        cdQ = cute.make_identity_tensor((self.tile_m, self.d))
        coords = cu.acc_mn_view(thr.partition_C(cdQ))
        acc_mn = cu.acc_mn_view(acc_dQ)
        for r in cutlass.range_constexpr(cute.size(coords, mode=[0])):
            pos = first_q + coords[r, 0][0]
            if pos < seqlen_q:
                g = self.row(mdQ, cfg.varlen_q, batch, offset_q, pos, head)
                for c in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                    g[coords[r, c][1]] = dt(acc_mn[r, c] * softmax_scale)
