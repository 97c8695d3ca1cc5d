"""Forward attention kernel for SM120/SM121 (and SM80/SM90, which run the same instructions).

Layouts (torch order, last dim contiguous, rows 16-byte aligned):
    q, out  (B, Sq, Hq, D|Dv)   or varlen (total_q, Hq, D|Dv) with cu_seqlens_q (B+1,) int32
    k, v    (B, Sk, Hkv, D|Dv)  or varlen (total_k, Hkv, D|Dv) with cu_seqlens_k (B+1,) int32
            or paged (num_pages, page_size, Hkv, D|Dv) with page_table (B, max_pages_per_seq) int32
    lse     (B, Hq, Sq) fp32    or varlen (Hq, total_q)
    seqused_q/k (B,) int32 (optional), sink (Hq,) fp32 (optional)

Algorithm (FlashAttention-2 on mma.sync m16n8k16):
    one CTA = one tile of ``tile_m`` query rows of one (batch, head group); warps are stacked along M.
    Q is loaded once (cp.async) and, if ``q_in_regs``, kept in registers as mma A fragments.
    KV blocks stream through ``num_stages`` smem stages with cp.async, last block first (paged K/V: row by row,
    each row's address from the page table, so a block may span pages of any size); with S >= 2 stages,
    V(j-S+1) loads while S = Q K(j)^T runs, K(j-S) loads while softmax and O += P V(j) run (one stage: V(j), then
    K(j-1)).  P stays in registers (the S accumulator
    is re-read as the A operand).  Only boundary blocks are masked (``BlockInfo.kv_plan``
    in block_info.py; the masks themselves are ``Mask.apply`` in score_mask.py, called by ``ScoreHook.apply``).
    The epilogue stages O in smem (aliasing the Q/K/V buffers) for 16-byte coalesced stores, and writes the
    natural-log LSE.
    Packed GQA (runtime ``pack`` = 1 or Hq/Hkv): tile rows enumerate (position, head-in-group) pairs.

Constraints: fp16/bf16; head dims from config.HEAD_DIMS; smem <= 101376 B (config.fwd_tile_problems).

Profile:  ncu --set full -k regex:kernel_cutlass python benchmarks/bench_fwd.py --only llama3-8b --seqlen 4096
"""

from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..arguments import BlockSparseLists, DropoutParams
from . import cute_utils as cu
from .block_sparse import SparseBlockInfo
from .fwd_base import FwdKernelBase


class FlashFwdCpAsync(FwdKernelBase):
    """cp.async forward kernel: every warp loads, computes and stores; one compiled kernel per frozen
    ``FwdKernelConfig``."""

    def compute_sync(self):
        cute.arch.barrier()

    # ------------------------------------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        k: cute.Tensor,
        v: cute.Tensor,
        out: cute.Tensor,
        lse: cute.Tensor,
        cu_seqlens_q: cute.Tensor | None,
        cu_seqlens_k: cute.Tensor | None,
        seqused_q: cute.Tensor | None,
        seqused_k: cute.Tensor | None,
        page_table: cute.Tensor | None,
        sink: cute.Tensor | None,
        sparse: BlockSparseLists | None,
        aux_tensors,  # the mods' aux tensors (a tuple) or None
        scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        pack: Int32,
        qheads_per_kvhead: Int32,
        num_m_blocks: Int32,
        num_head_groups: Int32,
        num_batch: Int32,
        dropout: DropoutParams | None,
        stream,
    ):
        dt = self.dtype
        atom_q = cu.smem_layout_atom(dt, self.d)
        atom_v = cu.smem_layout_atom(dt, self.dv)
        sQ_layout = cute.tile_to_shape(atom_q, (self.tile_m, self.d), (0, 1))
        sK_layout = cute.tile_to_shape(atom_q, (self.tile_n, self.d, self.num_stages), (0, 1, 2))
        sV_layout = cute.tile_to_shape(atom_v, (self.tile_n, self.dv, self.num_stages), (0, 1, 2))
        sO_layout = cute.tile_to_shape(atom_v, (self.tile_m, self.dv), (0, 1))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]

        tiled_mma = cu.tiled_mma_16816(dt, self.mma_warps)
        copy_q = cu.gmem_tiled_copy(dt, self.d, self.num_mma_threads, is_async=True)
        copy_v = cu.gmem_tiled_copy(dt, self.dv, self.num_mma_threads, is_async=True)
        copy_o = cu.gmem_tiled_copy(dt, self.dv, self.num_mma_threads, is_async=False)
        self.launch_smem_bytes = SharedStorage.size_in_bytes()  # read by the compile gate
        self.kernel(
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, sink,
            sparse, aux_tensors, scale_log2, softcap_prescale, window_left, window_right, pack, qheads_per_kvhead,
            num_m_blocks, dropout,
            sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_v, copy_o, SharedStorage,
        ).launch(
            grid=(num_m_blocks + self.grid_x_extra, num_head_groups, num_batch),
            block=(self.num_mma_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            # one CTA per SM is what SM120's 99 KB allows; without this ptxas may cap registers (168) to fit three
            # and spill (seen at d=256/dv=96)
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedQ: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        mSink: cute.Tensor | None,
        sparse: BlockSparseLists | None,
        mAux,
        scale_log2: Float32,
        softcap_prescale: Float32,
        window_left: Int32,
        window_right: Int32,
        pack: Int32,
        qheads_per_kvhead: Int32,
        num_m_blocks: Int32,
        dropout: DropoutParams | None,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        copy_q: cute.TiledCopy,
        copy_v: cute.TiledCopy,
        copy_o: cute.TiledCopy,
        SharedStorage: cutlass.Constexpr,
    ):
        # thread and block indices are read inside each branch: live across the branch they would be spilled
        # around the producer's setmaxnreg
        bx, _, _ = self.cta_coords()
        rows_q, rows_k = self.seq_rows(mQ, mK, mPageTable)
        tile = partial(
            self.run_tile, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink,
            sparse, mAux, scale_log2, softcap_prescale, window_left, window_right, pack, qheads_per_kvhead,
            num_m_blocks,
            sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_v, copy_o, SharedStorage,
            rows_q, rows_k, dropout,
        )
        self.tile_or_fill(bx, num_m_blocks, tile, mO, mLSE, mCuSeqlensQ, mSeqUsedQ, rows_q, pack, self.num_mma_threads)

    @cute.jit
    def run_tile(
        self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink, sparse, mAux,
        scale_log2, softcap_prescale, window_left, window_right, pack, qheads_per_kvhead, num_m_blocks, sQ_layout,
        sK_layout, sV_layout, sO_layout, tiled_mma, copy_q, copy_v, copy_o, SharedStorage: cutlass.Constexpr, rows_q, rows_k,
        dropout,
    ):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bx, head_group, bz = self.cta_coords()
        batch, split = self.split_coords(bz, mO)
        self.release_dependents()
        # Causal/windowed tiles near the end of the sequence have the most work (and a causal-like block list's):
        # schedule them first.
        if const_expr(cfg.windowed or cfg.block_sparse):
            m_block = num_m_blocks - 1 - bx
        else:
            m_block = bx
        ts = self.tile_state(batch, head_group, m_block, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
                             mSeqUsedK, scale_log2, softcap_prescale, window_left, window_right, pack, mK,
                             mPageTable, split, dropout, mAux)
        if m_block * self.tile_m < ts.num_rows:
            self.process_tile(ts, mQ, mK, mV, mO, mLSE, mSink, sparse, qheads_per_kvhead, sQ_layout, sK_layout,
                              sV_layout, sO_layout, tiled_mma, copy_q, copy_v, copy_o, SharedStorage, tidx)

    @cute.jit
    def process_tile(
        self, ts, mQ, mK, mV, mO, mLSE, mSink, sparse, qheads_per_kvhead, sQ_layout, sK_layout, sV_layout,
        sO_layout, tiled_mma, copy_q, copy_v, copy_o, SharedStorage: cutlass.Constexpr, tidx,
    ):
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)
        sV = storage.sV.get_tensor(sV_layout)
        sVt = cu.transpose_view(sV)
        # the mma's thread index and the K / V^T stages it reads (a key-split kernel: its group's keys)
        mma_tidx, sK_mma, sVt_mma = self.mma_operands(tidx, sK, sVt)

        kv_head = (ts.head_group * ts.pack) // qheads_per_kvhead
        thr_copy_k = copy_q.get_slice(tidx)
        thr_copy_v = copy_v.get_slice(tidx)
        tKsK, tVsV = thr_copy_k.partition_D(sK), thr_copy_v.partition_D(sV)
        tKgK, tVgV = None, None
        if const_expr(not self.is_paged()):  # paged K/V: rows are addressed one by one (load_kv_rows)
            gK = cute.local_tile(ts.kv.head_view(mK, kv_head), (self.tile_n, self.d), (None, 0))
            gV = cute.local_tile(ts.kv.head_view(mV, kv_head), (self.tile_n, self.dv), (None, 0))
            tKgK, tVgV = thr_copy_k.partition_S(gK), thr_copy_v.partition_S(gV)
        cK = cute.make_identity_tensor((self.tile_n, self.d))
        cV = cute.make_identity_tensor((self.tile_n, self.dv))
        tKcK, t0KcK = thr_copy_k.partition_S(cK), copy_q.get_slice(0).partition_S(cK)
        tVcV, t0VcV = thr_copy_v.partition_S(cV), copy_v.get_slice(0).partition_S(cV)

        # ---- mma partitions
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK_mma[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt_mma[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.dv)), Float32)
        acc_O.fill(0.0)
        ldsm_copy_q = cute.make_tiled_copy_A(cu.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(mma_tidx)
        ldsm_copy_k = cute.make_tiled_copy_B(cu.ldmatrix_atom(self.dtype, False), tiled_mma).get_slice(mma_tidx)
        ldsm_copy_v = cute.make_tiled_copy_B(cu.ldmatrix_atom(self.dtype, True), tiled_mma).get_slice(mma_tidx)
        tSsQ = ldsm_copy_q.partition_S(sQ)
        tSsK = ldsm_copy_k.partition_S(sK_mma)
        tOsVt = ldsm_copy_v.partition_S(sVt_mma)

        tScS_mn, t0ScS_mn, row_qpos = self.row_coords(tiled_mma, mma_tidx, ts.m_block, ts.pack)
        row_bh = self.row_bh(ts, tScS_mn)
        num_my_rows = cute.size(row_qpos)
        state_max = cute.make_rmem_tensor(num_my_rows, Float32)
        state_sum = cute.make_rmem_tensor(num_my_rows, Float32)
        state_max.fill(-Float32.inf)
        state_sum.fill(0.0)

        block = ts.block
        if const_expr(self.cfg.block_sparse):  # the listed KV blocks of this query block (kernels/block_sparse.py)
            block = SparseBlockInfo.from_block(ts.block, self.cfg.sparse_q_ratio, self.cfg.sparse_kv_ratio,
                                               sparse, ts.seq.batch, ts.head_group * ts.pack, ts.m_block)
        plan = block.kv_plan(ts.m_block)
        n_min, n_max = plan[0], plan[1]

        if n_max > n_min:
            # ---- prologue: Q, then the first stages of K/V
            self.load_q(mQ, sQ, copy_q, tidx, ts)
            cute.arch.cp_async_commit_group()
            seqlen_k = ts.seq.seqlen_k
            prefetch_k, prefetch_v = None, None
            if const_expr(self.is_paged()):
                load_k = partial(self.load_kv_rows, copy_q, lambda pos: ts.kv.row(mK, pos, kv_head), tKsK, tKcK,
                                 seqlen_k, False)
                load_v = partial(self.load_kv_rows, copy_v, lambda pos: ts.kv.row(mV, pos, kv_head), tVsV, tVcV,
                                 seqlen_k, True)
                # the main loop reads each block's page numbers at the top of the step that loads it, so the page
                # table's latency overlaps the barrier and the S mma instead of stalling the cp.async issue.  Not
                # on the one-stage tiles (d >= 192): the page registers spill the d256 64x64 tile.
                if const_expr(self.num_stages > 1):
                    prefetch_k = partial(self.prefetch_pages, ts.kv, tKcK,
                                         lambda page, pos: ts.kv.row_in(mK, page, pos, kv_head))
                    prefetch_v = partial(self.prefetch_pages, ts.kv, tVcV,
                                         lambda page, pos: ts.kv.row_in(mV, page, pos, kv_head))
            else:
                load_k = partial(self.load_kv, copy_q, tKgK, tKsK, tKcK, t0KcK, seqlen_k, False)
                load_v = partial(self.load_kv, copy_v, tVgV, tVsV, tVcV, t0VcV, seqlen_k, True)
            kv_tile = None
            if const_expr(self.cfg.block_sparse):
                # virtual tile -> listed KV tile; any listed tile may be partial or past the end: always predicate
                kv_tile = block.tile_of
                load_k = partial(self.load_listed, load_k, kv_tile)
                load_v = partial(self.load_listed, load_v, kv_tile)
            n_first = n_max - 1
            for s in cutlass.range_constexpr(self.num_stages):
                if const_expr(s == 0):
                    load_k(n_first, 0, True)
                else:
                    if n_first - s >= n_min:
                        load_k(n_first - s, s, False)
                cute.arch.cp_async_commit_group()
                if const_expr(s < self.num_stages - 1):
                    if const_expr(s == 0):
                        load_v(n_first, 0, True)
                    else:
                        if n_first - s >= n_min:
                            load_v(n_first - s, s, False)
                    cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(self.num_stages * 2 - 1)
            if const_expr(self.q_in_regs):
                cute.arch.barrier()
                cute.copy(ldsm_copy_q, tSsQ, ldsm_copy_q.retile(tSrQ))

            step = partial(
                self.kv_step,
                tiled_mma=tiled_mma, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt,
                ldsm_copy_q=ldsm_copy_q, ldsm_copy_k=ldsm_copy_k, ldsm_copy_v=ldsm_copy_v, acc_O=acc_O,
                state_max=state_max, state_sum=state_sum, load_k=load_k, load_v=load_v, n_min=n_min,
                score=ts.score, tScS_mn=tScS_mn, t0ScS_mn=t0ScS_mn, row_qpos=row_qpos, row_bh=row_bh, kv_tile=kv_tile,
                prefetch_k=prefetch_k, prefetch_v=prefetch_v,
            )
            # ---- main loop: first block (all masks), then phases A (right+left), B (none), C (left)
            block.run_kv_schedule(step, Int32(0), plan)
            # drain the (empty) groups still in flight before smem is reused by the epilogue
            cute.arch.cp_async_wait_group(0)

        # ---- epilogue
        sO = cute.make_tensor(sQ.iterator, sO_layout)
        self.tile_epilogue(storage, ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx,
                           mma_tidx, tScS_mn)

    def mma_operands(self, tidx, sK, sVt):
        """(mma thread index, K stages, V^T stages) of this thread's mma: every thread sees the whole tiles here;
        a key-split kernel (fwd_decode.py) gives each warp group its share of the keys."""
        return tidx, sK, sVt

    @cute.jit
    def tile_epilogue(self, storage, ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx,
                      mma_tidx, tScS_mn):
        """After the last K/V tile: the epilogue (a key-split kernel first merges its groups' states)."""
        self.epilogue(ts, acc_O, state_max, state_sum, mLSE, mSink, mO, sO, tiled_mma, copy_o, tidx, tScS_mn)

    @cute.jit
    def next_stage(self, stage: Int32) -> Int32:
        """The stage of the next (lower) K/V block: block n_first - i sits in stage i % num_stages."""
        if const_expr(self.num_stages == 1):
            return stage
        elif const_expr(self.num_stages == 2):
            return 1 - stage
        else:
            return (stage + 1) % self.num_stages

    @cute.jit
    def kv_step(
        self,
        n_block: Int32,
        stage: Int32,
        tiled_mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, ldsm_copy_q, ldsm_copy_k, ldsm_copy_v, acc_O,
        state_max, state_sum, load_k, load_v, n_min, score, tScS_mn, t0ScS_mn, row_qpos, row_bh, kv_tile,
        prefetch_k, prefetch_v,
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_right: cutlass.Constexpr[bool],
        mask_left: cutlass.Constexpr[bool],
        mask_mod_on: cutlass.Constexpr[bool] = True,
    ):
        """One KV block: S = Q K^T, mask, online softmax, O += P V, with the next loads in flight.  ``kv_tile``:
        None, or (block sparsity) the map from the schedule's virtual index ``n_block`` to the real KV tile."""
        stages = self.num_stages
        rd = stage if const_expr(stages > 1) else 0
        # V(n - stages + 1) goes to the stage V(n + 1) left (every warp passed its PV: the barrier below)
        wr = 0
        if const_expr(stages == 2):
            wr = 1 - stage
        elif const_expr(stages > 2):
            wr = (stage + stages - 1) % stages
        dropout = self.dropout_apply(score, tScS_mn, t0ScS_mn, row_qpos, row_bh, n_block)
        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C((self.tile_m, self.s_tile_n)),
                                     Float32)
        acc_S.fill(0.0)
        v_next = n_block if const_expr(stages == 1) else n_block - (stages - 1)
        k_next = n_block - 1 if const_expr(stages == 1) else n_block - stages
        if const_expr(prefetch_v is not None):  # paged: this step's page numbers, read before the waits
            load_v = prefetch_v(load_v, v_next)
            load_k = prefetch_k(load_k, k_next)

        # K(n) has landed (and, with one stage, everyone finished reading V(n+1))
        cute.arch.cp_async_wait_group(stages * 2 - 2)
        cute.arch.barrier()
        if const_expr(stages == 1):
            load_v(n_block, 0, is_first)
        else:
            if v_next >= n_min:
                load_v(v_next, wr, False)
        cute.arch.cp_async_commit_group()

        cu.mma_ss(tiled_mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, rd], ldsm_copy_q, ldsm_copy_k,
                  self.q_in_regs)

        if const_expr(stages == 1):
            cute.arch.cp_async_wait_group(0)  # V(n) landed; all warps done with K(n)
            cute.arch.barrier()
            if n_block - 1 >= n_min:
                load_k(n_block - 1, 0, False)
            cute.arch.cp_async_commit_group()

        n_real = n_block
        if const_expr(kv_tile is not None):
            n_real = kv_tile(n_block)
        tOrP = self.scores_to_p(score, acc_S, acc_O, state_max, state_sum, tScS_mn, t0ScS_mn, row_qpos, dropout,
                                n_real, is_first, mask_seqlen, mask_right, mask_left, mask_mod_on)

        if const_expr(stages > 1):
            cute.arch.cp_async_wait_group(stages * 2 - 2)  # V(n) landed
            cute.arch.barrier()  # all warps done with K(n): its stage takes K(n - stages)
            if k_next >= n_min:
                load_k(k_next, rd, False)
            cute.arch.cp_async_commit_group()

        cu.mma_rs(tiled_mma, acc_O, tOrP, tOrVt, tOsVt[None, None, None, rd], ldsm_copy_v)
        return self.next_stage(stage)

    @cute.jit
    def load_listed(self, load, kv_tile, t: Int32, stage, need_pred: cutlass.Constexpr[bool]):
        """Block sparsity: load the KV tile listed at virtual index ``t``, predicated on the sequence end."""
        load(kv_tile(t), stage, True)

    @cute.jit
    def load_kv(self, tiled_copy, tXgX, tXsX, tXcX, t0XcX, seqlen_k: Int32, zero_fill: cutlass.Constexpr[bool],
                block: Int32, stage, need_pred: cutlass.Constexpr[bool]):
        """cp.async one K or V block into ``stage``.  Rows past seqlen_k are skipped (K: masked later) or
        zero-filled (V: P is 0 there, but 0 * garbage could be NaN)."""
        if const_expr(need_pred):
            limit = seqlen_k - block * self.tile_n - tXcX[0][0]
            for n in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
                if t0XcX[0, n, 0][0] < limit:
                    cute.copy(tiled_copy, tXgX[None, n, None, block], tXsX[None, n, None, stage])
                else:
                    if const_expr(zero_fill):
                        tXsX[None, n, None, stage].fill(0)
        else:
            cute.copy(tiled_copy, tXgX[None, None, None, block], tXsX[None, None, None, stage])

    def prefetch_pages(self, kv, tXcX, row_in, load, block: Int32):
        """Paged K/V: read the page numbers of this thread's rows of KV block ``block`` now (any block: the table
        column is clamped) and return ``load`` with its row addresses taken from them."""
        rows = cute.size(tXcX.shape[1])
        pages = cute.make_rmem_tensor(rows, Int32)
        first = block * self.tile_n
        for m in range(rows):  # trace-time loop (this helper is plain Python: it returns a partial)
            pages[m] = kv.page_of(first + tXcX[0, m, 0][0])
        return partial(load.func, load.args[0], (pages, row_in), *load.args[2:])

    @cute.jit
    def load_kv_rows(self, tiled_copy, row_of, tXsX, tXcX, seqlen_k: Int32, zero_fill: cutlass.Constexpr[bool],
                     block: Int32, stage, need_pred: cutlass.Constexpr[bool]):
        """cp.async one K or V block into ``stage``, each row from its own address ``row_of(pos)`` (paged K/V).
        Rows past seqlen_k are never read (the rest of a last page may hold anything, even NaN): K rows there are
        skipped (masked later), V rows zero-filled (P is 0 there, but 0 * garbage could be NaN)."""
        vec = cute.size(tXsX.shape[0][0])
        first = block * self.tile_n
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            pos = first + tXcX[0, m, 0][0]
            row = row_of
            if const_expr(isinstance(row_of, tuple)):  # (pages read ahead by prefetch_pages, row_in)
                row = partial(row_of[1], row_of[0][m])
            if const_expr(need_pred):
                if pos < seqlen_k:
                    g = cute.tiled_divide(row(pos), (vec,))
                    for kk in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
                        cute.copy(tiled_copy, g[None, tXcX[0, 0, kk][1] // vec], tXsX[None, m, kk, stage])
                else:
                    if const_expr(zero_fill):
                        tXsX[None, m, None, stage].fill(0)
            else:
                g = cute.tiled_divide(row(pos), (vec,))
                for kk in cutlass.range_constexpr(cute.size(tXsX.shape[2])):
                    cute.copy(tiled_copy, g[None, tXcX[0, 0, kk][1] // vec], tXsX[None, m, kk, stage])
