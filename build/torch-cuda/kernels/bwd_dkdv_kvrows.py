"""Backward dK/dV kernel with keys as the mma rows (config ``kv_rows``) — KV-stationary, cp.async, SM120's 99 KB.

Same algorithm, arguments and walk as bwd_dkdv.py (one CTA = ``tile_n`` keys of one KV head, every query head of
its group and every query block that sees them; dK/dV summed over the group in registers, stored once), but S
and dP are computed transposed, one warp per 16 keys over all ``tile_m`` queries of the block:

    S^T = K Q^T, P^T = exp2(S^T c - LSE), dP^T = V dO^T, dS^T = P^T (dP^T - D)
    dV += P^T dO, dK += dS^T Q       (P^T and dS^T straight from the accumulators into the A operand)

A warp's rows of S^T are its rows of dV and dK, so P and dS never go through shared memory: no P/dS buffers (the
space double-buffers Q and dO instead) and no barrier to change the mma partition.  Per query block the CTA
crosses one barrier: the cp.async of block i+1 is issued right after it and has the whole of block i to land.
The score hook sees the accumulators as [query, key] (``Mask.transposed``), so masks, softcap, score/mask
mods and the backward's P/dS are the same code as everywhere else.  Block sparsity walks the KV-major lists as
bwd_dkdv.py does (``SparseQList``, the entry carried to the prefetch); dropout's keep bits come from
``Dropout.bits_keyrows`` (a lane pair shares each Philox call: a thread's two keys of one call are 8
apart).  Feature sets that spill this kernel on sm_120a run bwd_dkdv.py (config_bwd._BWD_SPILLING).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from . import cute_utils as cu
from .block_sparse import SparseQList
from .bwd_dkdv import FlashBwdDkdv, bwd_tiled_mma
from .rows import load_rows, store_rows_from_acc


class FlashBwdDkdvKvRows(FlashBwdDkdv):
    def smem_plan(self):
        """Two stages of Q and dO (no P / dS buffers: P^T and dS^T stay in registers), K and V of the CTA's keys,
        and with dropout the dP sums of two query blocks (see ``process``).  The P/dS layout slot of the
        parent's kernel signature gets Q's (unused)."""
        dt = self.dtype
        a = cu.smem_layout_atom
        sQ_l = cute.tile_to_shape(a(dt, self.d), (self.tile_m, self.d, 2), (0, 1, 2))
        sdO_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_m, self.dv, 2), (0, 1, 2))
        sK_l = cute.tile_to_shape(a(dt, self.d), (self.tile_n, self.d), (0, 1))
        sV_l = cute.tile_to_shape(a(dt, self.dv), (self.tile_n, self.dv), (0, 1))

        def smem(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]

        fields = {"sQ": smem(dt, sQ_l), "sdO": smem(dt, sdO_l), "sK": smem(dt, sK_l), "sV": smem(dt, sV_l)}
        if const_expr(self.cfg.has_dropout):
            fields["sDps"] = cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.tile_m], 16]
        return (sQ_l, sdO_l, sK_l, sV_l, sQ_l), cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def tiled_mmas(self):
        """One mma over key rows for every product: 16 keys per warp, wn = 1 (config_bwd.bwd_problems)."""
        mma = bwd_tiled_mma(self.dtype, self.tile_n, self.num_warps)
        return mma, mma

    @cute.jit
    def load_q_do_stage(self, seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, head, m_block, stage):
        """cp.async Q and dO of query tile ``m_block`` of query head ``head`` into ``stage``, one group."""
        first_q = m_block * self.tile_m
        load_rows(lambda pos: seq.q_row(mQ, pos, head), sQ[None, None, stage], copy_d, tidx, first_q,
                  seq.seqlen_q, (self.tile_m, self.d), True)
        load_rows(lambda pos: seq.q_row(mdO, pos, head), sdO[None, None, stage], copy_dv, tidx, first_q,
                  seq.seqlen_q, (self.tile_m, self.dv), True)
        cute.arch.cp_async_commit_group()

    def branch_masks(self) -> bool:
        """``FlashBwdDkdv.branch_masks`` for this kernel: dense windowed walks at head dim 128 only, where the branch
        per tile measured faster than masking every tile (most with dropout); at d64 it made no difference and at
        d96 it was slower (per-kernel times, causal: benchmarks/experiments/results/bwd_mask_branch_h100_s28.jsonl)."""
        cfg = self.cfg
        return (not cfg.block_sparse and cfg.mods is None and cfg.windowed
                and max(cfg.head_dim, cfg.head_dim_v) >= 128)

    @cute.jit
    def process(
        self, seq, block, score, kv, mQ, mK, mV, mdO, mLSE, mDpsum, mdK, mdV, mDqAccum, sparse, softmax_scale,
        qheads_per_kvhead, sQ_l, sdO_l, sK_l, sV_l, sP_l, mma_m, mma_n, copy_d, copy_dv, SharedStorage: cutlass.Constexpr, tidx,
        n_block, kv_head,
    ):
        cfg = self.cfg
        dt = self.dtype
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ, sdO = storage.sQ.get_tensor(sQ_l), storage.sdO.get_tensor(sdO_l)  # (tile_m, d | dv, stage)
        sK, sV = storage.sK.get_tensor(sK_l), storage.sV.get_tensor(sV_l)
        sDps = None
        if const_expr(cfg.has_dropout):
            sDps = storage.sDps.get_tensor(cute.make_layout(2 * self.tile_m))
        sQt, sdOt = cu.transpose_view(sQ), cu.transpose_view(sdO)  # (d | dv, tile_m, stage)
        score = score.as_transposed()

        first_key = n_block * self.tile_n
        load_rows(lambda pos: kv.row(mK, pos, kv_head), sK, copy_d, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.d), True)
        load_rows(lambda pos: kv.row(mV, pos, kv_head), sV, copy_dv, tidx, first_key, seq.seqlen_k,
                  (self.tile_n, self.dv), True)
        cute.arch.cp_async_commit_group()

        ld = cu.ldmatrix_atom
        thr = mma_n.get_slice(tidx)
        # S^T = K Q^T, dP^T = V dO^T: A = K / V (this warp's 16 keys), B = Q / dO (the block's queries)
        acc_shape_s = thr.partition_shape_C((self.tile_n, self.tile_m))
        tSrK = thr.make_fragment_A(thr.partition_A(sK))
        tSrQ = thr.make_fragment_B(thr.partition_B(sQ[None, None, 0]))
        tPrV = thr.make_fragment_A(thr.partition_A(sV))
        tPrdO = thr.make_fragment_B(thr.partition_B(sdO[None, None, 0]))
        cpA = cute.make_tiled_copy_A(ld(dt, False), mma_n).get_slice(tidx)
        cpB = cute.make_tiled_copy_B(ld(dt, False), mma_n).get_slice(tidx)
        tSsK, tSsQ = cpA.partition_S(sK), cpB.partition_S(sQ)
        tPsV, tPsdO = cpA.partition_S(sV), cpB.partition_S(sdO)
        # dV += P^T dO, dK += dS^T Q: A from the accumulators, B = dO^T / Q^T (read transposed)
        tVrdOt = thr.make_fragment_B(thr.partition_B(sdOt[None, None, 0]))
        tKrQt = thr.make_fragment_B(thr.partition_B(sQt[None, None, 0]))
        cpBt = cute.make_tiled_copy_B(ld(dt, True), mma_n).get_slice(tidx)
        tVsdOt, tKsQt = cpBt.partition_S(sdOt), cpBt.partition_S(sQt)
        acc_dV = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.dv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr.partition_shape_C((self.tile_n, self.d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)

        # coordinates (query, key) of this thread's / thread 0's S^T elements, viewed [query, key] like the scores
        cSt = cu.transpose_view(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        tScS_mn = score.mn(thr.partition_C(cSt))
        t0ScS_mn = score.mn(mma_n.get_slice(0).partition_C(cSt))
        num_rows = cute.size(tScS_mn, mode=[0])
        row_qpos = cute.make_rmem_tensor(num_rows, Int32)
        lse_log2 = cute.make_rmem_tensor(num_rows, Float32)
        dpsum = cute.make_rmem_tensor(num_rows, Float32)

        # the walk: every query tile of the window for each head of the group (heads outer), or (block sparsity)
        # the listed query blocks of this KV block (kernels/block_sparse.py SparseQList).  The entry is carried from
        # one block to the next (dense: by increment, not by dividing the block index; sparse: next_entry, which
        # walks the lists only where a new block starts), and the next one is found at the top of the iteration,
        # before the wait, so its loads overlap the cp.async in flight
        first_head = kv_head * qheads_per_kvhead
        head, m_block, masked = first_head, Int32(0), Int32(1)
        if const_expr(cfg.block_sparse):
            qlist = SparseQList.create(cfg.sparse_q_ratio, cfg.sparse_kv_ratio, self.tile_m, sparse, seq.batch,
                                       first_head, qheads_per_kvhead, n_block, seq.seqlen_q)
            num_iters = qlist.num_tiles()
            if num_iters > 0:
                head, m_block, masked = qlist.locate(Int32(0))
        else:
            m_min, m_max = block.q_range(n_block)
            num_m = cutlass.max(m_max - m_min, 0)
            num_iters = num_m * qheads_per_kvhead
            m_block = m_min
        if num_iters > 0:
            self.load_q_do_stage(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, head, m_block, Int32(0))
        for it in cutlass.range(num_iters, unroll=1):
            stage = it % 2
            first_q = m_block * self.tile_m
            for r in cutlass.range_constexpr(num_rows):  # loads in flight while the cp.async lands
                pos = first_q + tScS_mn[r, 0][0]
                row_qpos[r] = pos
                lse_log2[r] = Float32.inf
                dpsum[r] = 0.0
                if pos < seq.seqlen_q:
                    idx = seq.row_stat_index(head, pos)
                    lse_log2[r] = score.lse_log2(mLSE[idx])
                    dpsum[r] = mDpsum[idx]
            next_head, next_m_block, next_masked = head, m_block + 1, masked
            if const_expr(cfg.block_sparse):
                next_head, next_m_block, next_masked = qlist.next_entry(it + 1, head, m_block, masked)
            else:
                if next_m_block == m_max:
                    next_head, next_m_block = head + 1, m_min
            cute.arch.cp_async_wait_group(0)
            # Q/dO of this block visible to all, and every warp done with the previous block's stage, which the
            # prefetch below overwrites
            cute.arch.barrier()
            dps = dpsum
            if const_expr(cfg.has_dropout):
                # with dropout the dP sums wait in shared memory (two blocks' worth, by stage) from here to dS, not
                # in registers across the keep bits, the S mma and the score hook: with the Philox counter of
                # dropout.py the d128 tile was 2-3 registers short with window + dropout.  A thread reads back only
                # rows it wrote itself (other threads write the same values), so no barrier is needed
                for r in cutlass.range_constexpr(num_rows):
                    sDps[stage * self.tile_m + tScS_mn[r, 0][0]] = dpsum[r]
                dps = cu.SmemRows(sDps, stage * self.tile_m, [tScS_mn[r, 0][0] for r in range(num_rows)])
            if it + 1 < num_iters:
                self.load_q_do_stage(seq, mQ, mdO, sQ, sdO, copy_d, copy_dv, tidx, next_head, next_m_block,
                                     1 - stage)

            drop_bits = None
            if const_expr(cfg.has_dropout):  # before the S mma: S and dP are not live yet
                drop_bits = score.dropout.bits_keyrows(tScS_mn, t0ScS_mn, row_qpos, (seq.batch << 16) | head,
                                                       n_block)
            acc_S = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_S.fill(0.0)
            cu.mma_ss(mma_n, acc_S, tSrK, tSrQ, tSsK, tSsQ[None, None, None, stage], cpA, cpB, False)
            acc_raw = None
            if const_expr(self.wants_raw_scores()):  # the scaled scores before the score_mod, for its backward
                acc_raw = cute.make_rmem_tensor(acc_shape_s, Float32)
            hook = score
            if const_expr(cfg.block_sparse and (cfg.windowed or self.has_mask_mod())):  # on mask blocks only
                hook = score.for_sparse_block(masked != 0, gate_branch=True)
            needs_mask = None  # every tile masked, or (branch_masks) only those a mask cuts
            if const_expr(self.branch_masks()):
                needs_mask = block.tile_needs_mask(m_block, n_block)
            hook.apply_backward(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, head, acc_raw, needs_mask)
            acc_P = cute.make_rmem_tensor(acc_shape_s, Float32)
            score.backward_p(acc_S, lse_log2, acc_P)
            acc_dP = cute.make_rmem_tensor(acc_shape_s, Float32)
            acc_dP.fill(0.0)
            cu.mma_ss(mma_n, acc_dP, tPrV, tPrdO, tPsV, tPsdO[None, None, None, stage], cpA, cpB, False)
            # dS; with dropout (drop_bits) from the dropped, rescaled dP, and acc_P becomes P * keep (for dV)
            score.backward_ds(acc_S, acc_P, acc_dP, dps, drop_bits)
            if const_expr(self.wants_raw_scores()):
                score.backward_mods(acc_dP, acc_raw, tScS_mn, t0ScS_mn, row_qpos, head, n_block)
            # both to 16 bits before the dV mma: the fp32 dS is not live across it (registers)
            rP = cute.make_rmem_tensor_like(acc_P, dt)
            rP.store(acc_P.load().to(dt))
            rdS = cute.make_rmem_tensor_like(acc_dP, dt)
            rdS.store(acc_dP.load().to(dt))
            cu.mma_rs(mma_n, acc_dV, cu.acc_as_operand_a(rP), tVrdOt, tVsdOt[None, None, None, stage], cpBt)
            cu.mma_rs(mma_n, acc_dK, cu.acc_as_operand_a(rdS), tKrQt, tKsQt[None, None, None, stage], cpBt)
            head, m_block, masked = next_head, next_m_block, next_masked

        acc_dK.store(acc_dK.load() * softmax_scale)
        if const_expr(cfg.has_dropout):  # dV = (P * keep / (1-p))^T dO: the 1/(1-p) once
            acc_dV.store(acc_dV.load() * score.dropout.scale)
        store_rows_from_acc(lambda pos: kv.row(mdK, pos, kv_head), acc_dK, thr, first_key, seq.seqlen_k,
                            (self.tile_n, self.d), dt)
        store_rows_from_acc(lambda pos: kv.row(mdV, pos, kv_head), acc_dV, thr, first_key, seq.seqlen_k,
                            (self.tile_n, self.dv), dt)
