"""dQ kernel of the backward (Q-stationary, atomic-free).

One CTA owns ``tile_m`` query rows of one head and walks the visible key blocks in a fixed ascending order,
recomputing S = Q K^T, P, dP = dO V^T and dS = P (dP - D) like the main backward kernel, and accumulates
dQ = dS K in registers (dS goes straight from the accumulator into the A operand, like P in the forward).  No
atomics: the summation order is fixed, so dQ is bitwise reproducible.  dK/dV come from bwd_dkdv.py (also
atomic-free).  It recomputes S and dP once more, yet the pair beat dQ-by-atomics on the H100 proxy.

Block sparsity (config ``block_sparse``): the CTA walks only the KV blocks the forward's (Q-major) lists give its
query block, full blocks then mask blocks (kernels/block_sparse.py SparseBlockInfo); mask blocks get the
causal/window masks when the call has them, full blocks only the sequence end.  A query tile with no block writes
dQ = 0.

Layouts as bwd_dkdv.py; dq is written in q's dtype (scaled by the softmax scale), rows past the sequence are
left to the host's zero fill.
"""

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import BlockSparseLists, BWD_DQ_ARGS, DropoutParams
from ..config_bwd import BwdKernelConfig
from . import cute_utils as cu
from .fwd_base import DTYPES
from .block_sparse import SparseBlockInfo
from .kernel_state import KernelStateMixin
from .rows import load_rows, store_rows_from_acc


class FlashBwdDq(KernelStateMixin):
    ARGS = BWD_DQ_ARGS

    def __init__(self, cfg: BwdKernelConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n, self.num_warps = cfg.tile_m, cfg.tile_n, cfg.num_warps
        self.kv_stages = cfg.kv_stages
        # one K/V stage: V and K waited for separately (``split_kv_wait``, config DqKernelConfig; dense walk and
        # block-sparse lists, ``sparse_loop``)
        self.split_kv_wait = cfg.kv_stages == 1 and getattr(cfg, "split_kv_wait", False)
        self.num_threads = cfg.num_warps * 32
        # the d256 dQ tiles (64x32) spill on sm_120a with the row loop of Dropout.bits and not when it is
        # unrolled (compile gate)
        self.dropout_row_loop = cfg.tile_n > 32
        # the d192 dQ tile (64x64, 4 warps) spilled on sm_120a in its heaviest dropout set (d192/dv192 and
        # d192/dv32) with the four Philox calls of a row pair unrolled, and not in a loop (compile gate)
        self.dropout_group_loop = cfg.tile_m == 64 and cfg.tile_n == 64

    @cute.jit
    def __call__(
        self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, dout: cute.Tensor, lse: cute.Tensor,
        dpsum: cute.Tensor, dq: cute.Tensor, pdpsum: cute.Tensor | None, cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None, seqused_q: cute.Tensor | None, seqused_k: cute.Tensor | None,
        sparse: BlockSparseLists | None,
        aux_tensors,  # the mods' aux tensors (a tuple) or None
        scale_log2: Float32, softcap_prescale: Float32, softmax_scale: Float32, window_left: Int32,
        window_right: Int32, qheads_per_kvhead: Int32, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32,
        dropout: DropoutParams | None, stream,
    ):
        dt = self.dtype
        a = cu.smem_layout_atom
        sQ_l = cute.tile_to_shape(a(dt, self.d), (self.tile_m, self.d), (0, 1))
        sdO_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_m, self.dv), (0, 1))
        sK_l = cute.tile_to_shape(a(dt, self.d), (self.tile_n, self.d, self.kv_stages), (0, 1, 2))
        sV_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_n, self.dv, self.kv_stages), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_l)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_l)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_l)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_l)], 1024]

        self.launch_smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            q, k, v, dout, lse, dpsum, dq, pdpsum, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sparse,
            aux_tensors, scale_log2, softcap_prescale, softmax_scale, window_left, window_right, qheads_per_kvhead,
            dropout,
            sQ_l, sdO_l, sK_l, sV_l,
            cu.tiled_mma_16816(dt, self.num_warps), cu.gmem_tiled_copy(dt, self.d, self.num_threads, is_async=True),
            cu.gmem_tiled_copy(dt, self.dv, self.num_threads, is_async=True), SharedStorage,
        ).launch(
            grid=(num_m_blocks, num_heads, num_batch), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), min_blocks_per_mp=1, stream=stream,
        )

    @cute.kernel
    def kernel(
        self, mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, sparse, mAux,
        scale_log2: Float32, softcap_prescale: Float32, softmax_scale: Float32, window_left: Int32,
        window_right: Int32, qheads_per_kvhead: Int32, dropout: DropoutParams | None,
        sQ_l: cute.ComposedLayout, sdO_l: cute.ComposedLayout,
        sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout, tiled_mma: cute.TiledMma, copy_d: cute.TiledCopy,
        copy_dv: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.windowed or self.cfg.block_sparse):
            # longest query tiles first (causal / window / block lists: the last query tiles see the most keys),
            # so the heaviest CTAs do not make the tail of the grid
            num_m, _, _ = cute.arch.grid_dim()
            m_block = num_m - 1 - m_block
        st = self.kernel_state(batch, *self.seq_rows(mQ, mK), mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK,
                               scale_log2, softcap_prescale, window_left, window_right, 1, dropout=dropout,
                               aux=mAux)
        seq, block, score, kv = st.seq, st.block, st.score, st.kv
        if m_block * self.tile_m < seq.seqlen_q:
            self.process(seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, sparse, softmax_scale,
                         qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, tiled_mma, copy_d, copy_dv, SharedStorage, tidx,
                         m_block, head)

    @cute.jit
    def process(self, seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdQ, mPdPsum, sparse, softmax_scale,
                qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, tiled_mma, copy_d, copy_dv,
                SharedStorage: cutlass.Constexpr, tidx, m_block, head):
        cfg = self.cfg
        dt = self.dtype
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_l), storage.sdO.get_tensor(sdO_l)
        sK, sV = storage.sK.get_tensor(sK_l), storage.sV.get_tensor(sV_l)
        sKt = cu.transpose_view(sK)  # (d, tile_n, stage)
        kv_head = head // qheads_per_kvhead
        first_q = m_block * self.tile_m
        load_rows(lambda pos: seq.q_row(mQ, pos, head), sQ, copy_d, tidx, first_q, seq.seqlen_q,
                  (self.tile_m, self.d), True)
        load_rows(lambda pos: seq.q_row(mdO, pos, head), sdO, copy_dv, tidx, first_q, seq.seqlen_q,
                  (self.tile_m, self.dv), True)
        cute.arch.cp_async_commit_group()

        ld = cu.ldmatrix_atom
        thr = tiled_mma.get_slice(tidx)
        cpA = cute.make_tiled_copy_A(ld(dt, False), tiled_mma).get_slice(tidx)
        cpB = cute.make_tiled_copy_B(ld(dt, False), tiled_mma).get_slice(tidx)
        cpBt = cute.make_tiled_copy_B(ld(dt, True), tiled_mma).get_slice(tidx)
        tSrQ, tSrK = thr.make_fragment_A(thr.partition_A(sQ)), thr.make_fragment_B(thr.partition_B(sK[None, None, 0]))
        tPrdO = thr.make_fragment_A(thr.partition_A(sdO))
        tPrV = thr.make_fragment_B(thr.partition_B(sV[None, None, 0]))
        tQrKt = thr.make_fragment_B(thr.partition_B(sKt[None, None, 0]))
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
        pdp = cute.make_rmem_tensor(num_rows, Float32)  # sum_j P_ij dP_ij in fp32 (cfg.sink_grad): D without O's rounding
        pdp.fill(0.0)
        for r in cutlass.range_constexpr(num_rows):
            pos = first_q + tScS_mn[r, 0][0]
            row_qpos[r] = pos
            lse_log2[r] = Float32.inf
            dpsum[r] = 0.0
            if pos < seq.seqlen_q:
                idx = seq.row_stat_index(head, pos)
                lse_log2[r] = score.lse_log2(mLSE[idx])
                dpsum[r] = mDpsum[idx]

        # the KV tiles to visit, tile ``t`` given by ``where(t)`` -> (n_block, masked): the visible range in
        # ascending order, or (block sparsity, ``sparse_loop``) the listed KV blocks of this query block
        # (kernels/block_sparse.py): virtual tiles [0, F) full, [F, F + M) mask.  A fixed order either way: dQ stays
        # bitwise reproducible.
        if const_expr(cfg.block_sparse):
            sp = SparseBlockInfo.from_block(block, cfg.sparse_q_ratio, cfg.sparse_kv_ratio, sparse, seq.batch, head,
                                            m_block)
            _, total, _, n_full, _ = sp.kv_plan(m_block)
        else:
            n_min, n_max = block.kv_range(m_block)
            total = cutlass.max(n_max - n_min, 0)
            where = partial(self.dense_entry, n_min)
        load_kv = partial(self.load_kv, seq, kv, mK, mV, sK, sV, copy_d, copy_dv, tidx, kv_head)
        step = partial(self.step, seq, score, tiled_mma, acc_shape_s, acc_dQ, tSrQ, tSrK, tSsQ, tSsK, tPrdO, tPrV,
                       tPsdO, tPsV, tQrKt, tQsKt, cpA, cpB, cpBt, tScS_mn, t0ScS_mn, row_qpos, lse_log2, dpsum, pdp,
                       head, block, m_block)  # step(n_block, masked, stage)
        if const_expr(cfg.block_sparse):
            self.sparse_loop(sp, load_kv, step, total, n_full,
                             partial(self.load_k, seq, kv, mK, sK, copy_d, tidx, kv_head),
                             partial(self.k_ready_v_next, seq, kv, mV, sV, copy_dv, tidx, kv_head))
        elif const_expr(self.kv_stages > 1):
            # K/V of tile t + 1 stream into the other stage while tile t is computed: one barrier per tile (it
            # also orders every warp's reads of tile t - 1, whose stage the prefetch overwrites)
            if total > 0:
                load_kv(where(Int32(0))[0], Int32(0))
            for t in cutlass.range(total, unroll=1):
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                if t + 1 < total:
                    load_kv(where(t + 1)[0], (t + 1) % 2)
                n_block, masked = where(t)
                step(n_block, masked, t % 2)
        elif const_expr(self.split_kv_wait):
            # one stage, V and K in their own cp.async groups: dP (V) first while K lands; once every warp is past
            # dP, V of the next tile streams in under S, dS and dQ; K of the next tile, once every warp is past dQ,
            # under the next dP
            if total > 0:
                self.load_v(seq, kv, mV, sV, copy_dv, tidx, kv_head, n_min)
                self.load_k(seq, kv, mK, sK, copy_d, tidx, kv_head, n_min)
            for t in cutlass.range(total, unroll=1):
                n_block, masked = where(t)
                cute.arch.cp_async_wait_group(1)  # V of this tile (K may be in flight)
                cute.arch.barrier()
                step(n_block, masked, Int32(0),
                     after_dp=partial(self.k_ready_v_next, seq, kv, mV, sV, copy_dv, tidx, kv_head, n_block + 1,
                                      t + 1 < total))
                cute.arch.barrier()  # every warp is done with K before the next tile overwrites it
                if t + 1 < total:
                    self.load_k(seq, kv, mK, sK, copy_d, tidx, kv_head, n_block + 1)
        else:
            for t in cutlass.range(total, unroll=1):
                n_block, masked = where(t)
                load_kv(n_block, Int32(0))
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                step(n_block, masked, Int32(0))
                cute.arch.barrier()  # every warp is done with K/V before the next tile overwrites them

        if const_expr(cfg.sink_grad):
            # per-row sum of P * dP (the learnable-sink gradient uses it: exact D, not rowsum(dO * bf16 O))
            for r in cutlass.range_constexpr(num_rows):
                total = cu.quad_allreduce_sum(pdp[r])
                if tScS_mn[0, 0][1] == 0 and row_qpos[r] < seq.seqlen_q:
                    mPdPsum[seq.row_stat_index(head, row_qpos[r])] = total

        acc_dQ.store(acc_dQ.load() * softmax_scale)
        store_rows_from_acc(lambda pos: seq.q_row(mdQ, pos, head), acc_dQ, thr, first_q, seq.seqlen_q,
                            (self.tile_m, self.d), dt)

    @cute.jit
    def sparse_loop(self, sp, load_kv, step, total, n_full, load_k, k_ready_v_next):
        """The dense loops' schedule over a block-sparse list: virtual tile t = 0, 1, .. is KV tile
        ``sp.tile_of(t)``, a mask tile when ``t >= n_full``.  Each KV tile is looked up one iteration before its K/V
        load and carried: the index load then overlaps the wait for the cp.async in flight instead of stalling the
        cp.async that needs it, each tile is looked up once, and a tile inside the block of the previous one needs
        no load (``SparseBlockInfo.next_tile``).  With ``split_kv_wait`` the loop of the dense schedule's: V and K
        in their own groups, V of the next tile issued between this tile's dP and S (``k_ready_v_next``), K after
        its dQ."""
        if const_expr(self.kv_stages > 1):
            # cur: the tile computed in this iteration, nxt: the one whose K/V stream in meanwhile
            cur = Int32(0)
            nxt = Int32(0)
            if total > 0:
                cur = sp.tile_of(Int32(0))
                load_kv(cur, Int32(0))
            if total > 1:
                nxt = sp.next_tile(Int32(1), cur)
            for t in cutlass.range(total, unroll=1):
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                after = nxt
                if t + 1 < total:
                    load_kv(nxt, (t + 1) % 2)
                    if t + 2 < total:
                        after = sp.next_tile(t + 2, nxt)
                step(cur, t >= n_full, t % 2)
                cur = nxt
                nxt = after
        elif const_expr(self.split_kv_wait):
            cur = Int32(0)
            if total > 0:
                cur = sp.tile_of(Int32(0))
                k_ready_v_next(cur, True, wait=False)  # V of the first tile (nothing in flight yet)
                load_k(cur)
            for t in cutlass.range(total, unroll=1):
                nxt = cur
                if t + 1 < total:
                    nxt = sp.next_tile(t + 1, cur)
                cute.arch.cp_async_wait_group(1)  # V of this tile (K may be in flight)
                cute.arch.barrier()
                step(cur, t >= n_full, Int32(0), after_dp=partial(k_ready_v_next, nxt, t + 1 < total))
                cute.arch.barrier()  # every warp is done with K before the next tile overwrites it
                if t + 1 < total:
                    load_k(nxt)
                cur = nxt
        else:
            cur = Int32(0)
            if total > 0:
                cur = sp.tile_of(Int32(0))
            for t in cutlass.range(total, unroll=1):
                load_kv(cur, Int32(0))
                nxt = cur
                if t + 1 < total:
                    nxt = sp.next_tile(t + 1, cur)
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()
                step(cur, t >= n_full, Int32(0))
                cute.arch.barrier()  # every warp is done with K/V before the next tile overwrites them
                cur = nxt

    @cute.jit
    def dense_entry(self, n_min, t):
        return n_min + t, True

    @cute.jit
    def load_k(self, seq, kv, mK, sK, copy_d, tidx, kv_head, n_block):
        """cp.async K of key tile ``n_block`` into the single stage, one group."""
        load_rows(lambda pos: kv.row(mK, pos, kv_head), sK[None, None, 0], copy_d, tidx, n_block * self.tile_n,
                  seq.seqlen_k, (self.tile_n, self.d), True)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_v(self, seq, kv, mV, sV, copy_dv, tidx, kv_head, n_block):
        """cp.async V of key tile ``n_block`` into the single stage, one group."""
        load_rows(lambda pos: kv.row(mV, pos, kv_head), sV[None, None, 0], copy_dv, tidx, n_block * self.tile_n,
                  seq.seqlen_k, (self.tile_n, self.dv), True)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def k_ready_v_next(self, seq, kv, mV, sV, copy_dv, tidx, kv_head, next_block, has_next,
                       wait: cutlass.Constexpr[bool] = True):
        """Between the dP and S mmas of the split-wait loop: K of this tile landed and visible, every warp past
        its reads of V, then V of the next tile (``next_block``) issued.  ``wait=False``: the issue alone (the
        prologue)."""
        if const_expr(wait):
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
        if has_next:
            self.load_v(seq, kv, mV, sV, copy_dv, tidx, kv_head, next_block)

    @cute.jit
    def load_kv(self, seq, kv, mK, mV, sK, sV, copy_d, copy_dv, tidx, kv_head, n_block, stage):
        """cp.async K and V of key tile ``n_block`` into ``stage`` (rows past the sequence zero-filled)."""
        first_key = n_block * self.tile_n
        load_rows(lambda pos: kv.row(mK, pos, kv_head), sK[None, None, stage], copy_d, tidx, first_key,
                  seq.seqlen_k, (self.tile_n, self.d), True)
        load_rows(lambda pos: kv.row(mV, pos, kv_head), sV[None, None, stage], copy_dv, tidx, first_key,
                  seq.seqlen_k, (self.tile_n, self.dv), True)
        cute.arch.cp_async_commit_group()

    def branch_masks(self) -> bool:
        """Trace time: whether ``step`` masks only the tiles that need it (``BlockInfo.tile_needs_mask``, a branch
        per tile) instead of every tile: dense walks without mods (block-sparse walks mask by block kind), except
        the windowed one without dropout, where the branch measured slower than masking every tile.  Without a
        window the sequence-end mask leaves all tiles but the last, so the branch skips most of the masking (d128
        per-kernel times: benchmarks/experiments/results/bwd_mask_branch_h100_s28.jsonl)."""
        cfg = self.cfg
        return not cfg.block_sparse and cfg.mods is None and (not cfg.windowed or cfg.has_dropout)

    @cute.jit
    def step(self, seq, score, tiled_mma, acc_shape_s, acc_dQ, tSrQ, tSrK, tSsQ, tSsK, tPrdO, tPrV, tPsdO, tPsV,
             tQrKt, tQsKt, cpA, cpB, cpBt, tScS_mn, t0ScS_mn, row_qpos, lse_log2, dpsum, pdp, head, block, m_block,
             n_block, masked, stage, after_dp=None):
        """One KV tile (K/V in smem ``stage``): S, P, dP, dS, dQ += dS K.  ``masked`` (block sparsity with
        causal/window): whether this tile gets the causal/window masks (a mask block) or only the sequence end (a
        full block)."""
        cfg = self.cfg
        dt = self.dtype
        drop_bits = None
        if const_expr(cfg.has_dropout):  # before the S mma: S and dP are not live yet (score.py)
            drop_bits = score.dropout.bits(tScS_mn, t0ScS_mn, row_qpos, (seq.batch << 16) | head, n_block)
        if const_expr(after_dp is not None):  # dP first (V), then ``after_dp`` (K's wait, V's next load), then S
            acc_dP = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_dP.fill(0.0)
            cu.mma_ss(tiled_mma, acc_dP, tPrdO, tPrV, tPsdO, tPsV[None, None, None, stage], cpA, cpB, False)
            after_dp()
        acc_S = cute.make_rmem_tensor(acc_shape_s, Float32)
        acc_S.fill(0.0)
        cu.mma_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, stage], cpA, cpB, False)
        acc_raw = None
        if const_expr(self.wants_raw_scores()):  # the scaled scores before the score_mod, for its backward
            acc_raw = cute.make_rmem_tensor(acc_shape_s, Float32)
        hook = score
        if const_expr(cfg.block_sparse and (cfg.windowed or self.has_mask_mod())):  # on mask blocks only
            # the mod's verdict gated, no branch (Mask.gate_branch measured slower here, d128 S=16K causal as a
            # block mask, and faster in the key-row dK/dV kernel, which keeps it)
            hook = score.for_sparse_block(masked)
        needs_mask = None  # every tile masked, or (branch_masks) only those a mask cuts
        if const_expr(self.branch_masks()):
            needs_mask = block.tile_needs_mask(m_block, n_block)
        hook.apply_backward(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, head, acc_raw, needs_mask)
        if const_expr(after_dp is None):
            acc_dP = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_dP.fill(0.0)
            cu.mma_ss(tiled_mma, acc_dP, tPrdO, tPrV, tPsdO, tPsV[None, None, None, stage], cpA, cpB, False)
        score.backward_p_ds(acc_S, acc_dP, lse_log2, dpsum, acc_S, pdp, False, cfg.sink_grad, drop_bits)
        if const_expr(self.wants_raw_scores()):
            score.backward_mods(acc_dP, acc_raw, tScS_mn, t0ScS_mn, row_qpos, head, n_block)
        rdS = cute.make_rmem_tensor_like(acc_dP, dt)
        rdS.store(acc_dP.load().to(dt))
        cu.mma_rs(tiled_mma, acc_dQ, cu.acc_as_operand_a(rdS), tQrKt, tQsKt[None, None, None, stage], cpBt)
