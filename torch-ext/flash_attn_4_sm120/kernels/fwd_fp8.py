"""FP8 (e4m3) attention forward for SM120/SM121 and the H100 proxy: ``mma.sync m16n8k32 e4m3`` for both GEMMs.

Layouts (the host passes the e4m3 tensors as uint8 views; the kernel reads bytes):
  q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): last dim contiguous, rows 16-byte aligned;
  out (B, Sq, Hq, Dv) bf16/fp16, lse (B, Hq, Sq) fp32 (natural log); q/k/v_descale (B, Hkv) fp32.
Grid (ceil(Sq / tile_m), Hq, B), 4 warps of 16 query rows (the packed decode tile: one 16-row block, below);
query head h reads KV head h // (Hq / Hkv).

Algorithm, per CTA:
  * Q is copied to shared memory once (cp.async, padded rows as K/V) and read as A fragments one 32-column chunk
    at a time (4 x 32-bit reads).
  * K/V tiles of 64 keys are double-buffered in shared memory by cp.async (keys past Sk zero-filled), each row
    padded by 16 bytes so the 4-byte fragment reads hit 32 distinct banks (no swizzle).
  * S = Q·Kᵀ: a K row's 4 bytes at column 4t are exactly a B-fragment register (no ldmatrix, no transpose).
  * Online softmax in the log2 domain, scale = softmax_scale · log2(e) · q_descale · k_descale; KV tiles right
    to left.  Softcap (cfg.softcap): the scores become cap · tanh(s / cap) of the descaled, softmax-scaled score s,
    in log2 units (cap · log2(e)) · tanh(acc · q_descale · k_descale · softmax_scale / cap), with tanh(x) =
    1 − 2 / (2^(2x·log2 e) + 1) from ex2.approx and rcp.approx (``softcap_scores``).  The LSE is the capped
    problem's, in natural-log units; the sink logit is not capped (as the bf16 kernels and the reference).  P is formed as exp2(s − m + 4) = 16·P (at most 16, four binades above e4m3's subnormals), converted
    to e4m3 with saturation, while the row sum adds the fp32 values.  out = acc · v_descale / row_sum (the 16s
    cancel).
  * P·V without moving P: the accumulator of S tiles (4c, 4c+1) row g holds keys {2t, 2t+1, 8+2t, 9+2t} of
    k-chunk c, which is what an A register holds once the chunk's keys are read in that order.  V is read in
    the same key order: four 4-byte words (rows 2t, 2t+1, 8+2t, 9+2t; columns 4g..4g+3) transposed with eight
    byte permutes give the B registers of the four n8 tiles whose thread g owns columns 4g+i, i = 0..3.  Thread
    t then owns output columns 8t..8t+7 of each 32-column block: one 16-byte store per row and block.
  (SM120 has an 8-bit transposing ldmatrix; the H100 proxy does not, so this file uses none.)
  * Causal / sliding window: KV tiles outside every row's range are never loaded; the tiles that cross an edge
    are masked.  A learnable sink joins the denominator in the epilogue.
  * Varlen (cfg.varlen): q/out (1, total_q, H, D) and k/v (1, total_k, Hkv, D) packed rows, lse (1, Hq, total_q);
    sequence b has rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] and keys cu_seqlens_k[b] .. + seqused_k[b] (the
    host makes all three, on the device, for dense tensors: a contiguous KV cache with cache_seqlens is this).
  * Packed GQA (cfg.pack_gqa, varlen form only): grid y runs over KV heads and a CTA's tile row p (packed index
    m_block * tile_m + r) is query row p // qpk of query head hkv * qpk + p % qpk (qpk = Hq / Hkv, runtime), so
    the query heads of a group share each K/V tile instead of each re-reading the cache.  Masks and the sequence
    end use the query row; Q loads, O / LSE stores and the sink use the row's own head.
  * Split-KV (cfg.split, varlen form only): grid z folds (sequence, split) as z = b * splits + s (splits = out's
    leading extent); split s walks its share [lo, hi) of the CTA's tile range (block_info.py's rule: runs of
    ceil(count / splits) tiles) and writes fp32 partials, out (splits, total_q, Hq, Dv) normalized by its own sum
    with v_descale applied and lse (splits, Hq, total_q); an empty share writes O = 0, LSE = -inf, and the sink
    joins split 0 only.  The host combines them (splitkv.combine_into, kernels/combine.py).
  * Paged K/V (cfg.paged, varlen form only): k/v are page pools (num_pages, page_size, Hkv, D) and key j of
    sequence b is row j % page_size of page page_table[b, j // page_size], looked up per K/V row (any page size
    >= 1: a 64-key tile may span pages); the sequence holds clamp(seqused_k[b], 0, max_pages * page_size) keys
    and page indices are clamped to [0, num_pages), so a lying table reads wrong pages, never outside the pool.
    Lane l of a warp reads the page of the warp's l-th row of the tile once; the copies get it by a shuffle
    (load_kv_paged).  The math is the contiguous kernel's: paged and contiguous give bit-identical results.
  * Key-split decode tile (cfg.kv_warps > 1, the packed decode tile of config_fp8: tile_m 16): the kv_warps warps
    share the 16 rows; every thread copies its share of each whole K/V tile as above, and warp w multiplies keys
    [w, w + 1) x tile_n / kv_warps of it (S, masks with its own first key, its own online softmax, O_w += P_w V_w).
    After the last tile the other warps park O, row max and per-lane row sum in the K stages and warp 0 merges
    them (m = max, O and l rescaled by exp2 of the max differences) and runs the epilogue alone
    (merge_key_warps).  P is rounded to e4m3 against each warp's own running max, as a split rounds it against its
    own: the result differs from the one-warp tile's by that rounding only.  Paged, the page-table reads of the
    tile after next are issued a step ahead (page_ahead), and contiguous K/V rows are copied with a strided
    address (load_rows_strided).
  * A bf16/fp16 query (cfg.q_dtype, varlen form only: an FP8 KV cache under a high-precision model): q is read
    in its dtype (no q_descale) and each tile row, a (query row, head) pair, is quantized to e4m3 in registers
    with scale 448 / amax(row) into the same sQ rows (quantize_q_rows); the row's descale amax / 448 multiplies
    its scores with softmax_scale · log2(e) · k_descale, so the LSE is the unquantized problem's.  This replaces
    the host's per-(B, Hkv) quantization (several torch kernels a call) and is finer: one outlier only coarsens
    its own row's scale.
Constraints: D = Dv in {64, 128} (config_fp8.can_implement).
Profile: ncu --set full -k regex:kernel python -m pytest -q -m gpu tests/test_fp8_gpu.py -k "d128 and causal"
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..config_fp8 import ROW_PAD, Fp8FwdConfig, can_implement
from . import cute_utils as cu
from .fp8_kv_loader import Fp8KvLoader
from .fp8_ptx import (cp_async_16, cp_async_commit, cp_async_wait, cvt_bf16x2, cvt_e4m3x4, cvt_f16x2, exp2_approx,
                      ld_global_v4_u32, ld_shared_u32, log2_approx, mma_e4m3_16832, st_global_v4, st_global_v4_f32,
                      st_shared_v2, transpose_bytes_4x4, unpack_x2_f32)

E4M3_MAX = 448.0
P_SHIFT_LOG2 = 4.0  # P is scaled by 2^4 before the e4m3 conversion (tests/fp8_emulation.py models the same)
LN_2 = 0.6931471805599453
LOG2_E = 1.4426950408889634


class FlashFwdFp8(Fp8KvLoader):
    ARG_NAMES = ("q", "k", "v", "out", "lse", "q_descale", "k_descale", "v_descale", "sink", "cu_seqlens_q",
                 "cu_seqlens_k", "seqused_k", "page_table", "scale_log2", "softcap_log2", "window_left", "window_right",
                 "qheads_per_kvhead", "num_m_blocks")
    # with cfg.split, out / lse are the fp32 partials (splits, ...); with cfg.paged, k / v are the page pools
    # (num_pages, page_size, Hkv, D), page_table (B, max_pages) int32, and cu_seqlens_k is None.  With cfg.softcap,
    # scale_log2 is 2 · log2(e) · softmax_scale / cap (tanh's argument in exp2 units) and softcap_log2 is cap ·
    # log2(e); without it softcap_log2 is unused (scale_log2 = softmax_scale · log2(e))

    def __init__(self, cfg: Fp8FwdConfig):
        can_implement(cfg)
        self.cfg = cfg
        self.d, self.dv = cfg.head_dim, cfg.head_dim_v
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.num_threads = 32 * cfg.num_warps
        self.k_row = self.d + ROW_PAD  # bytes per padded smem row
        self.v_row = self.dv + ROW_PAD
        self.stages = cfg.num_stages
        self.kv_warps = cfg.kv_warps  # warps sharing a row block, each on its own keys of every K/V tile
        self.warp_n = cfg.tile_n // cfg.kv_warps  # the keys of a tile one warp multiplies
        # paged decode tile: the page-table reads of the tile after next are issued a tile ahead (its copies wait
        # on them otherwise: a dependent global read at the top of every step, with little work per step to hide it)
        self.page_ahead = cfg.paged and cfg.kv_warps > 1
        self.has_right = cfg.causal or cfg.local  # a right bound on the keys a row sees
        self.hp_q = cfg.q_dtype != "e4m3"  # a bf16/fp16 q, quantized per tile row here (quantize_q_rows)
        self.launch_smem_bytes = None

    @cute.jit
    def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 q_descale: cute.Tensor | None, k_descale: cute.Tensor, v_descale: cute.Tensor, sink: cute.Tensor | None,
                 cu_seqlens_q: cute.Tensor | None, cu_seqlens_k: cute.Tensor | None, seqused_k: cute.Tensor | None,
                 page_table: cute.Tensor | None, scale_log2: Float32, softcap_log2: Float32, window_left: Int32,
                 window_right: Int32, qheads_per_kvhead: Int32, num_m_blocks: Int32, stream):
        q_bytes = self.tile_m * self.k_row
        k_bytes = self.stages * self.tile_n * self.k_row
        v_bytes = self.stages * self.tile_n * self.v_row

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, q_bytes], 128]
            sK: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, k_bytes], 128]
            sV: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, v_bytes], 128]

        self.launch_smem_bytes = SharedStorage.size_in_bytes()  # read by the compile gate
        # varlen: one batch of packed rows (1, total, H, D), one grid slice per sequence
        batch = cu_seqlens_q.shape[0] - 1 if const_expr(self.cfg.varlen) else q.shape[0]
        heads = q.shape[2]
        if const_expr(self.cfg.pack_gqa):  # one CTA row per KV head
            heads = q.shape[2] // qheads_per_kvhead
        if const_expr(self.cfg.split):  # z folds (sequence, split)
            batch = batch * out.shape[0]
        # softcap: a per-thread register bound, else ptxas may cap registers at 168 to fit three CTAs per SM and
        # spill (d128 causal softcap did, 2 STL/LDL, where SM120's shared memory holds two 46 KB tiles anyway; as
        # fwd_cpasync.py; at d64 it may cost the third CTA).  Left off the other forms, whose SASS the committed
        # gate runs vouch for as built
        bound = dict(min_blocks_per_mp=1) if const_expr(self.cfg.softcap) else {}
        self.kernel(q, k, v, out, lse, q_descale, k_descale, v_descale, sink, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    page_table, scale_log2, softcap_log2, window_left, window_right, qheads_per_kvhead,
                    SharedStorage).launch(
            grid=(num_m_blocks, heads, batch), block=(self.num_threads, 1, 1),
            smem=SharedStorage.size_in_bytes(), stream=stream, **bound)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mQd: cute.Tensor | None, mKd: cute.Tensor, mVd: cute.Tensor, mSink: cute.Tensor | None,
               mCuQ: cute.Tensor | None, mCuK: cute.Tensor | None, mUsedK: cute.Tensor | None,
               mPT: cute.Tensor | None, scale_log2: Float32, softcap_log2: Float32,
               window_left: Int32, window_right: Int32, qheads_per_kvhead: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, h, b = cute.arch.block_idx()
        split = Int32(0)
        if const_expr(self.cfg.split):  # z = b * splits + split (uniform over the CTA)
            num_splits = mO.shape[0]
            bz = b
            b = cute.arch.make_warp_uniform(bz // num_splits)
            split = cute.arch.make_warp_uniform(bz - b * num_splits)
            # the combine (a programmatic dependent launch) may place its CTAs once every CTA here has started; it
            # waits in griddepcontrol.wait for this grid's end and writes (as fwd_base.release_dependents)
            cute.arch.griddepcontrol_launch_dependents()
        # packed GQA: tile row p is query row p // pack of head h * pack + p % pack (pack = 1: row p of head h)
        pack = qheads_per_kvhead if const_expr(self.cfg.pack_gqa) else 1
        warp, lane = tidx // 32, tidx % 32
        g, t = lane // 4, lane % 4
        kw, wr = 0, warp  # the warp's part of each tile's keys (first key kn) and its 16-row block
        if const_expr(self.kv_warps > 1):
            warp = cute.arch.make_warp_uniform(warp)
            kw, wr = warp % self.kv_warps, warp // self.kv_warps
        kn = kw * self.warp_n
        sq, sk = mQ.shape[1], mK.shape[1]
        bq = b  # the batch index of q/out/lse and k/v tensors (0 for packed varlen rows)
        q_off, k_off = Int32(0), Int32(0)  # the sequence's first row in them
        if const_expr(self.cfg.varlen):
            bq = 0
            # offsets and lengths are the caller's contract; clamped to the rows that exist, a lie gives wrong
            # numbers but never an out-of-bounds access (as the bf16 forward)
            q_off = cutlass.min(cutlass.max(mCuQ[b], 0), sq)
            sq = cutlass.min(cutlass.max(mCuQ[b + 1], q_off), sq) - q_off
            if const_expr(self.cfg.paged):
                # a sequence holds at most max_pages * page_size keys (the host checks the product fits int32), so
                # every page-table column read below is in range; no cu_seqlens_k (k_off stays 0)
                sk = Int32(mPT.shape[1]) * Int32(mK.shape[1])
            else:
                k_off = cutlass.min(cutlass.max(mCuK[b], 0), sk)
            # the host passes cu_seqlens_k's differences when no seqused_k is given (the capacity when paged)
            sk = cutlass.min(cutlass.max(mUsedK[b], 0), sk - k_off)
        hkv = h if const_expr(self.cfg.pack_gqa) else h // qheads_per_kvhead
        if const_expr(self.hp_q):  # each row's q descale joins after quantize_q_rows
            sl2k = scale_log2 * mKd[b, hkv]
        else:
            sl2 = scale_log2 * mQd[b, hkv] * mKd[b, hkv]
            sl2 = (sl2, sl2)  # (row g, row g + 8): one value for the whole tile
        row0 = m_block * self.tile_m + wr * 16 + g
        prow = (row0, row0 + 8)  # packed row indices (the query rows themselves without pack_gqa)
        rows = prow
        if const_expr(self.cfg.pack_gqa):
            rows = (row0 // pack, (row0 + 8) // pack)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ_addr = storage.sQ.get_tensor(cute.make_layout(self.tile_m * self.k_row)).iterator.toint()
        sK_addr = storage.sK.get_tensor(cute.make_layout(self.stages * self.tile_n * self.k_row)).iterator.toint()
        sV_addr = storage.sV.get_tensor(cute.make_layout(self.stages * self.tile_n * self.v_row)).iterator.toint()

        # Q tile -> shared memory (rows past Sq read row Sq - 1 and are never stored), in the first cp.async group.
        # Q fragments are read from there per 32-column chunk: holding all of Q in registers (16 at d128) spilled
        # where the mma is emulated (sm_90a: benchmarks/results/fp8_gate_sm90a.jsonl)
        q_base = mQ.iterator.toint() + Int64(bq) * Int64(mQ.stride[0]) + Int64(h) * Int64(mQ.stride[2])
        q_chunks = self.d // 16
        for j in cutlass.range_constexpr(0 if self.hp_q else self.tile_m * q_chunks // self.num_threads):
            idx = tidx + self.num_threads * j
            r, cidx = idx // q_chunks, idx % q_chunks
            q_row = cutlass.min(m_block * self.tile_m + r, sq - 1)
            if const_expr(self.cfg.pack_gqa):
                p = m_block * self.tile_m + r
                q_row = cutlass.min(p // pack, sq - 1)
                q_ok = q_row >= 0
                q_h = Int64(h * pack + p % pack - h) * Int64(mQ.stride[2])  # relative to q_base's head h
                cp_async_16(sQ_addr + r * self.k_row + cidx * 16,
                            q_base + q_h + Int64((q_off + q_row) if q_ok else 0) * Int64(mQ.stride[1])
                            + Int64(cidx * 16), 16 if q_ok else 0)
            elif const_expr(self.cfg.varlen):  # an empty sequence (sq = 0) reads nothing: zero-filled, never stored
                q_ok = q_row >= 0
                cp_async_16(sQ_addr + r * self.k_row + cidx * 16,
                            q_base + Int64((q_off + q_row) if q_ok else 0) * Int64(mQ.stride[1]) + Int64(cidx * 16),
                            16 if q_ok else 0)
            else:
                cp_async_16(sQ_addr + r * self.k_row + cidx * 16,
                            q_base + Int64(q_row) * Int64(mQ.stride[1]) + Int64(cidx * 16), 16)
        q_frag_addr = sQ_addr + (wr * 16 + g) * self.k_row + 4 * t

        # bottom-right aligned: row i sees keys j with i + shift - left <= j <= i + shift + right (the host passes
        # right = 0 for causal, and bounds that cover every key for an unbounded side)
        shift = sk - sq
        if const_expr(self.cfg.causal):  # causal fixes the right bound to 0 (a constant: fewer live registers)
            window_right = 0
        row_first = m_block * self.tile_m
        row_last = row_first + self.tile_m - 1
        if const_expr(self.cfg.pack_gqa):  # the query rows of the first and last packed rows
            row_first = row_first // pack
            row_last = cutlass.min(row_last // pack, cutlass.max(sq - 1, row_first))
        n_blocks = (sk + self.tile_n - 1) // self.tile_n
        n_max = n_blocks
        if const_expr(self.cfg.varlen):  # the grid covers the longest sequence: a tile past this one's rows is idle
            n_max = cutlass.max(cutlass.min(sq - row_first, 1), 0) * n_blocks
        if const_expr(self.has_right):
            limit = cutlass.max(row_last + shift + window_right + 1, 0)
            n_max = cutlass.min(n_max, (limit + self.tile_n - 1) // self.tile_n)
        n_min = 0
        if const_expr(self.cfg.local):
            n_min = cutlass.min(cutlass.max(row_first + shift - window_left, 0) // self.tile_n, n_max)
        if const_expr(self.cfg.split):  # this split's run of the CTA's tiles (possibly empty)
            per = (n_max - n_min + num_splits - 1) // num_splits
            lo = cutlass.min(n_min + split * per, n_max)
            n_max = cutlass.min(lo + per, n_max)
            n_min = lo
        n_iters = n_max - n_min

        k_base = (mK.iterator.toint() + Int64(bq) * Int64(mK.stride[0]) + Int64(k_off) * Int64(mK.stride[1])
                  + Int64(hkv) * Int64(mK.stride[2]))
        v_base = (mV.iterator.toint() + Int64(bq) * Int64(mV.stride[0]) + Int64(k_off) * Int64(mV.stride[1])
                  + Int64(hkv) * Int64(mV.stride[2]))
        # a row stride is H * D bytes (the host checks it fits 32 bits): one register each across the loop
        k_rs, v_rs = Int32(mK.stride[1]), Int32(mV.stride[1])
        pages = None  # paged: (table, batch entry, last page, page size, K / V page strides), read by load_kv
        if const_expr(self.cfg.paged):  # k_base / v_base: head hkv of page 0 (bq = k_off = 0)
            pages = (mPT, b, Int32(mK.shape[0]) - 1, Int32(mK.shape[1]), Int64(mK.stride[0]), Int64(mV.stride[0]))

        n_acc_s = self.warp_n // 8
        n_acc_o = self.dv // 8
        acc_o = cute.make_rmem_tensor((n_acc_o * 4,), Float32)
        acc_o.fill(0.0)
        row_m = cute.make_rmem_tensor((2,), Float32)
        row_m.fill(-Float32.inf)
        row_l = cute.make_rmem_tensor((2,), Float32)
        row_l.fill(0.0)
        acc_s = cute.make_rmem_tensor((n_acc_s * 4,), Float32)

        if n_iters > 0:
            self.load_kv(n_max - 1, 0, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages)
        cp_async_commit()
        ahead = None  # page_ahead: (page, row) pairs of the next tile to load, as lookup_pages gives them
        if const_expr(self.page_ahead):
            ahead = cute.make_rmem_tensor((2 * ((self.tile_n // self.cfg.num_warps + 31) // 32),), Int32)
            self.keep_pages(ahead, self.lookup_pages(cutlass.max(n_max - 2, 0), tidx, sk, pages))
        if const_expr(self.hp_q):  # while the first K/V tile is in flight; the loop's first barrier publishes it
            dq = self.quantize_q_rows(mQ, bq, h, m_block, wr, kw, g, t, pack, sq, q_off, sQ_addr)
            sl2 = (sl2k * dq[0], sl2k * dq[1])
        for it in cutlass.range(n_iters, unroll=1):
            nb = n_max - 1 - it
            stage = it % 2
            if it + 1 < n_iters:  # the next tile lands in the other stage while this one is used
                if const_expr(self.page_ahead):
                    self.copy_pages(1 - stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages,
                                    [(self.clamp_page(ahead[2 * i], pages), ahead[2 * i + 1])
                                     for i in range(cute.size(ahead.shape) // 2)])
                else:
                    self.load_kv(nb - 1, 1 - stage, tidx, sk, k_base, v_base, k_rs, v_rs, sK_addr, sV_addr, pages)
            cp_async_commit()
            if const_expr(self.page_ahead):  # tile nb - 2 (or any valid one past the range: never copied)
                self.keep_pages(ahead, self.lookup_pages(cutlass.max(nb - 2, 0), tidx, sk, pages))
            cp_async_wait(1)  # all but the newest group (an empty one on the last tile) have landed
            cute.arch.barrier()
            k_addr = sK_addr + stage * (self.tile_n * self.k_row)
            v_addr = sV_addr + stage * (self.tile_n * self.v_row)
            # S = Q K^T, one 32-column chunk of Q in registers at a time
            acc_s.fill(0.0)
            for c in cutlass.range_constexpr(self.d // 32):
                qc = [ld_shared_u32(q_frag_addr + 32 * c + 8 * self.k_row * (x % 2) + 16 * (x // 2)) for x in range(4)]
                for jt in cutlass.range_constexpr(n_acc_s):
                    k_row_addr = k_addr + (kn + 8 * jt + g) * self.k_row + 4 * t
                    bk = [ld_shared_u32(k_row_addr + 32 * c), ld_shared_u32(k_row_addr + 32 * c + 16)]
                    res = mma_e4m3_16832(qc, bk, [acc_s[4 * jt + e] for e in range(4)])
                    for e in cutlass.range_constexpr(4):
                        acc_s[4 * jt + e] = res[e]
            self.mask_and_scale(acc_s, nb * self.tile_n + kn, rows, t, row_first, row_last, sk, shift, window_left,
                                window_right, sl2, softcap_log2)
            pa = self.softmax_p(acc_s, row_m, row_l, acc_o)
            # O += P V
            for c in cutlass.range_constexpr(self.warp_n // 32):
                a_frag = pa[c]
                for cb in cutlass.range_constexpr(self.dv // 32):
                    halves = []
                    for hf in cutlass.range_constexpr(2):
                        key0 = kn + 32 * c + 16 * hf + 2 * t
                        w = [ld_shared_u32(v_addr + (key0 + dk) * self.v_row + 32 * cb + 4 * g) for dk in (0, 1, 8, 9)]
                        halves.append(transpose_bytes_4x4(w))
                    for i in cutlass.range_constexpr(4):
                        j = cb * 4 + i
                        res = mma_e4m3_16832(a_frag, [halves[0][i], halves[1][i]], [acc_o[4 * j + e] for e in range(4)])
                        for e in cutlass.range_constexpr(4):
                            acc_o[4 * j + e] = res[e]
            cute.arch.barrier()  # every warp is done with this stage before the next load refills it
        cp_async_wait(0)  # a CTA without KV tiles still has its Q copy in flight
        # v_descale read after the loop: a value live across it spilled where the mma is emulated (sm_90a)
        # with split, out / lse's leading index is the split (the varlen form has one batch of packed rows)
        if const_expr(self.kv_warps > 1):
            self.merge_key_warps(storage.sK.data_ptr(), acc_o, row_m, row_l, kw, wr, lane)
            if kw == 0:  # the first warp of each row block holds the merged rows
                self.epilogue(mO, mLSE, mSink, acc_o, row_m, row_l, mVd[b, hkv], rows, prow, sq,
                              split if const_expr(self.cfg.split) else bq, q_off, h, pack, split, t)
        else:
            self.epilogue(mO, mLSE, mSink, acc_o, row_m, row_l, mVd[b, hkv], rows, prow, sq,
                          split if const_expr(self.cfg.split) else bq, q_off, h, pack, split, t)

    @cute.jit
    def merge_key_warps(self, sK_ptr, acc_o, row_m, row_l, kw, wr, lane):
        """Key-split warps (cfg.kv_warps): warps kw > 0 of row block wr park their O registers, row maxima and
        per-lane row sums in the K stages (free once every warp is past the last tile; config_fp8.merge_bytes),
        laid out [row block, warp - 1][value][lane] so each access of a warp is 32 consecutive words; warp 0 of the
        block merges them: m = max(m_0, m_w), O = O_0 2^(m_0 - m) + O_w 2^(m_w - m), l likewise (log2 domain, all
        warps with the same 2^4 shift).  A row no warp saw keeps m = -inf: its factors are 0 (exp2 of -inf
        against 0) and the epilogue gives O = 0, LSE = -inf (or the sink); NaN in a warp's part propagates."""
        n_o = cute.size(acc_o.shape)
        vals = n_o + 4  # O, then (m, l) of rows g and g + 8
        parts = self.kv_warps - 1
        buf = cute.make_tensor(cute.recast_ptr(sK_ptr, dtype=Float32),
                               cute.make_layout((32, vals, parts * (self.cfg.num_warps // self.kv_warps))))
        cute.arch.barrier()  # every warp is past its last read of the K/V stages
        if kw > 0:
            mine = buf[lane, None, wr * parts + kw - 1]
            for i in cutlass.range_constexpr(n_o):
                mine[i] = acc_o[i]
            for hf in cutlass.range_constexpr(2):
                mine[n_o + hf] = row_m[hf]
                mine[n_o + 2 + hf] = row_l[hf]
        cute.arch.barrier()
        if kw == 0:
            for w in cutlass.range_constexpr(parts):
                theirs = buf[lane, None, wr * parts + w]
                for hf in cutlass.range_constexpr(2):
                    m_other = theirs[n_o + hf]
                    m_new = cute.arch.fmax(row_m[hf], m_other)
                    safe = 0.0 if m_new == -Float32.inf else m_new
                    c_mine = exp2_approx(row_m[hf] - safe)
                    c_other = exp2_approx(m_other - safe)
                    row_l[hf] = row_l[hf] * c_mine + theirs[n_o + 2 + hf] * c_other
                    row_m[hf] = m_new
                    for j in cutlass.range_constexpr(self.dv // 8):
                        for e in cutlass.range_constexpr(2):
                            i = 4 * j + 2 * hf + e
                            acc_o[i] = acc_o[i] * c_mine + theirs[i] * c_other

    @cute.jit
    def quantize_q_rows(self, mQ, bq, h, m_block, warp, kw, g, t, pack, sq, q_off, sQ_addr):
        """A bf16/fp16 q (cfg.q_dtype) -> e4m3 rows of sQ, each tile row with its own scale; returns the descales
        (amax / 448) of this thread's rows (g, g + 8 of its warp).  Quad g owns those two rows, lane t the 16-byte
        chunks t, t + 4, ... of each (8 values a chunk), so the row amax is a quad reduction and lands in the lanes
        whose S registers it scales.  ``warp``: the 16-row block; with key-split warps (``kw``: the warp's part)
        each warp of the block computes its rows' descales and the first one writes the rows.  The fragments are
        read after the loop's first barrier.  A row of zeros gets scale 0 and descale 0 (scores 0, as
        unquantized); NaN in a row gives NaN e4m3 values and so a NaN output row; rows past the sequence read its
        last row and are never stored."""
        fp16 = self.cfg.q_dtype == "fp16"
        esize = 2
        q_base = mQ.iterator.toint() + (Int64(bq) * Int64(mQ.stride[0]) + Int64(h) * Int64(mQ.stride[2])) * esize
        descales = []
        for hf in cutlass.range_constexpr(2):
            r = warp * 16 + g + 8 * hf
            p = m_block * self.tile_m + r
            q_row = cutlass.min(p, sq - 1)
            q_h = Int64(0)
            if const_expr(self.cfg.pack_gqa):  # packed row p: query row p // pack of head h * pack + p % pack
                q_row = cutlass.min(p // pack, sq - 1)
                q_h = Int64(h * pack + p % pack - h) * Int64(mQ.stride[2])
            q_ok = q_row >= 0  # an empty sequence reads row 0 of the tensor (host: total_q > 0), never stored
            row_addr = q_base + (q_h + Int64((q_off + q_row) if q_ok else 0) * Int64(mQ.stride[1])) * esize
            words = []
            for i in cutlass.range_constexpr(self.d // 32):
                words.extend(ld_global_v4_u32(row_addr + (t + 4 * i) * 16))
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(len(words)):
                for x in unpack_x2_f32(words[i], fp16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(x, -x))
            amax = cu.quad_allreduce_max(amax)
            scale = Float32(E4M3_MAX) / amax if amax > 0.0 else Float32(0.0)
            if kw == 0:
                for i in cutlass.range_constexpr(self.d // 32):
                    vals = [x * scale for j in range(4) for x in unpack_x2_f32(words[4 * i + j], fp16)]
                    st_shared_v2(sQ_addr + r * self.k_row + (t + 4 * i) * 8,
                                 [cvt_e4m3x4(*vals[:4]), cvt_e4m3x4(*vals[4:])])
            descales.append(amax * Float32(1.0 / E4M3_MAX))
        return descales

    @cute.jit
    def mask_and_scale(self, acc_s, n0, rows, t, row_first, row_last, sk, shift, left, right, sl2, softcap_log2):
        """Scores to the log2 domain (capped with cfg.softcap: ``softcap_scores``); keys past Sk or outside a row's
        (causal / window) range to -inf, on the tiles that cross an edge only.  ``n0``: the first key of this warp's
        part of the tile (warp_n keys)."""
        last = n0 + self.warp_n - 1
        need = last >= sk
        if const_expr(self.has_right):  # the first row's right edge
            need = need | (last > row_first + shift + right)
        if const_expr(self.cfg.local):  # the last row's left edge
            need = need | (n0 < row_last + shift - left)
        for i in cutlass.range_constexpr(cute.size(acc_s.shape)):  # registers 0, 1: row g; 2, 3: row g + 8
            acc_s[i] = acc_s[i] * sl2[(i % 4) // 2]
            if const_expr(self.cfg.softcap):
                acc_s[i] = self.softcap_scores(acc_s[i], softcap_log2)
        if need:
            for jt in cutlass.range_constexpr(self.warp_n // 8):
                for e in cutlass.range_constexpr(4):
                    key = n0 + 8 * jt + 2 * t + (e % 2)
                    bad = key >= sk
                    if const_expr(self.has_right):
                        bad = bad | (key > rows[e // 2] + shift + right)
                    if const_expr(self.cfg.local):
                        bad = bad | (key < rows[e // 2] + shift - left)
                    if bad:
                        acc_s[4 * jt + e] = -Float32.inf

    @cute.jit
    def softcap_scores(self, x, cap_log2):
        """cap · log2(e) · tanh(y) from x = 2y · log2(e): 2^x = e^(2y), tanh(y) = 1 − 2 / (e^(2y) + 1), written as
        cap_log2 − 2 cap_log2 / (2^x + 1) (one FFMA).  ex2.approx (relative error near 2^-22) and rcp.approx give
        tanh within about 2^-21 absolute, so the capped score is within cap_log2 · 2^-21 of the exact one, far
        below P's e4m3 step (tests/fp8_emulation.py emulates this form; the bf16 kernels' tanh.approx is off by
        up to 2^-11 relative, which would move P by 1% at cap 20 before its e4m3 rounding).  Large x: 2^x = inf,
        the reciprocal 0, the score cap_log2; very negative x: 2^x = 0, the score -cap_log2; NaN stays NaN."""
        r = cute.arch.rcp_approx(exp2_approx(x) + 1.0)
        return cap_log2 - (cap_log2 + cap_log2) * r

    @cute.jit
    def softmax_p(self, acc_s, row_m, row_l, acc_o):
        """Online softmax step; returns P as e4m3 A fragments, one list of 4 registers per 32-key chunk."""
        n_acc_s = self.warp_n // 8
        for hf in cutlass.range_constexpr(2):
            mx = row_m[hf]
            for jt in cutlass.range_constexpr(n_acc_s):
                mx = cute.arch.fmax(mx, cute.arch.fmax(acc_s[4 * jt + 2 * hf], acc_s[4 * jt + 2 * hf + 1]))
            mx = cu.quad_allreduce_max(mx)
            m_use = 0.0 if mx == -Float32.inf else mx
            corr = exp2_approx(row_m[hf] - m_use)
            offset = m_use - P_SHIFT_LOG2
            s = Float32(0.0)
            for jt in cutlass.range_constexpr(n_acc_s):
                for e in cutlass.range_constexpr(2):
                    p = exp2_approx(acc_s[4 * jt + 2 * hf + e] - offset)
                    acc_s[4 * jt + 2 * hf + e] = p
                    s = s + p
            row_l[hf] = row_l[hf] * corr + s
            row_m[hf] = mx
            for j in cutlass.range_constexpr(self.dv // 8):
                for e in cutlass.range_constexpr(2):
                    acc_o[4 * j + 2 * hf + e] = acc_o[4 * j + 2 * hf + e] * corr
        pa = []
        for c in cutlass.range_constexpr(self.warp_n // 32):
            j0 = 4 * c
            regs = []
            for pair in cutlass.range_constexpr(2):  # tiles (4c, 4c+1), then (4c+2, 4c+3)
                ja, jb = 4 * (j0 + 2 * pair), 4 * (j0 + 2 * pair + 1)
                for hf in cutlass.range_constexpr(2):
                    regs.append(cvt_e4m3x4(acc_s[ja + 2 * hf], acc_s[ja + 2 * hf + 1],
                                           acc_s[jb + 2 * hf], acc_s[jb + 2 * hf + 1]))
            pa.append(regs)  # [row g keys 0-15, row g+8 keys 0-15, row g keys 16-31, row g+8 keys 16-31]
        return pa

    @cute.jit
    def epilogue(self, mO, mLSE, mSink, acc_o, row_m, row_l, v_descale, rows, prow, sq, b, q_off, h, pack, split,
                 t):
        esize = 4 if const_expr(self.cfg.split) else 2  # fp32 partials, else bf16/fp16
        o_base = mO.iterator.toint() + Int64(b) * Int64(mO.stride[0]) * esize
        for hf in cutlass.range_constexpr(2):
            head = h
            if const_expr(self.cfg.pack_gqa):
                head = h * pack + prow[hf] % pack
            l = cu.quad_allreduce_sum(row_l[hf])
            m = row_m[hf]
            rescale = Float32(1.0)
            if const_expr(self.cfg.has_sink):
                # the sink logit joins the denominator (as 16 * exp2, like the scores); the max becomes
                # max(m, sink) so a large sink cannot overflow.  Written with < so a NaN sink propagates, and a
                # row with no keys and a -inf sink stays empty (O = 0, LSE = -inf)
                z = mSink[head] * LOG2_E
                if const_expr(self.cfg.split):  # the sink joins split 0 only (exact after the combine)
                    z = z if split == 0 else -Float32.inf
                m_fin = m if z < m else z
                rescale = 0.0 if m_fin == -Float32.inf else exp2_approx(m - m_fin)
                term = 0.0 if m_fin == -Float32.inf else exp2_approx(z - m_fin + P_SHIFT_LOG2)
                l = l * rescale + term
                m = m_fin
            inv = 0.0 if l == 0.0 else 1.0 / l
            factor = inv * v_descale * rescale
            row = rows[hf]
            if row < sq:
                o_row = o_base + (Int64(q_off + row) * Int64(mO.stride[1]) + Int64(head) * Int64(mO.stride[2])) * esize
                for cb in cutlass.range_constexpr(self.dv // 32):
                    vals = [acc_o[4 * (4 * cb + i) + 2 * hf + e] * factor for e in range(2) for i in range(4)]
                    if const_expr(self.cfg.split):  # columns 8t..8t+7: two 16-byte stores
                        st_global_v4_f32(o_row + (32 * cb + 8 * t) * 4, vals[:4])
                        st_global_v4_f32(o_row + (32 * cb + 8 * t) * 4 + 16, vals[4:])
                    elif const_expr(self.cfg.out_dtype == "bf16"):
                        regs = [cvt_bf16x2(vals[2 * x], vals[2 * x + 1]) for x in range(4)]
                    else:
                        regs = [cvt_f16x2(vals[2 * x], vals[2 * x + 1]) for x in range(4)]
                    if const_expr(not self.cfg.split):
                        st_global_v4(o_row + (32 * cb + 8 * t) * 2, regs)
                if t == 0:
                    lse = -Float32.inf if l == 0.0 else (m - P_SHIFT_LOG2 + log2_approx(l)) * LN_2
                    mLSE[b, head, q_off + row] = lse
