"""Block-sparse schedules (CuTe-DSL device code, trace time): the forward and the dQ kernel visit only the KV
blocks listed for their query block (``SparseBlockInfo``), instead of the contiguous range of ``BlockInfo``; the
dK/dV kernel visits only the query blocks listed for its KV block, for every query head of its KV head's group
(``SparseQList``, from the KV-major lists).

Metadata (host: block_sparse.py), per (batch, query head, user query block ``qb``):
    mask_cnt[b, h, qb], mask_idx[b, h, qb, :]   KV blocks that need the masks (causal / window / sequence end)
    full_cnt[b, h, qb], full_idx[b, h, qb, :]   KV blocks taken whole (only the sequence end is masked)
B and H extents of 1 broadcast.  A user block is ``q_ratio`` kernel query tiles by ``kv_ratio`` kernel KV tiles
(both compile-time), so kernel tile ``m_block`` reads the row of user block ``m_block // q_ratio`` and each listed
KV block expands to ``kv_ratio`` consecutive KV tiles.

The list is walked in a *virtual* order: virtual tile t in [0, F) is a full tile, t in [F, F + M) a mask tile
(F, M: tiles of the full / mask lists), visited from F + M - 1 down to 0 like the dense schedule, so the kernel's
prefetch of "the next block" (t - 1, t - 2) is unchanged; ``tile_of(t)`` maps a virtual tile to the real KV tile.

Index values are the caller's contract and are never trusted with an address: counts are clamped to
[0, width of the index tensor], indices to [0, ceil(seqlen_k / kv_block)] (one past the end is allowed: the
cp.async kernel predicates every load on the sequence end, the TMA kernel's loads read zeros past the end of the
tensor or rows past seqlen_k that it masks (K) and zeroes (V), so such a block is masked whole), and the query
block to the rows of the count tensor.  Every tile that reaches past the sequence end masks it (a listed block may be
the partial last one, or lie past a short varlen sequence), and so does every mask tile of a causal/windowed call;
the other tiles run without it.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .block_info import BlockInfo


def _clamp(x, lo, hi):
    return cutlass.min(cutlass.max(x, lo), hi)


@dataclass(frozen=True)
class SparseBlockInfo(BlockInfo):
    """``BlockInfo`` plus the sparse metadata of one query tile: the index rows of its user query block (1-D
    views, last dim contiguous) and their clamped counts.  Build with ``from_block`` (everything that is the same
    for the whole tile is read once, so the per-block lookup is one load)."""

    kv_ratio: int = 1
    mask_row: cute.Tensor = None
    full_row: cute.Tensor = None
    n_mask: Int32 = 0  # listed blocks (clamped), not tiles
    n_full: Int32 = 0

    @staticmethod
    @cute.jit
    def from_block(block: BlockInfo, q_ratio: cutlass.Constexpr[int], kv_ratio: cutlass.Constexpr[int], sparse,
                   batch, head, m_block) -> "SparseBlockInfo":
        """``sparse``: the kernel's Q-major lists (arguments.BlockSparseLists)."""
        qb = m_block // q_ratio
        rows = []
        mask_cnt, mask_idx, full_cnt, full_idx = sparse
        for mCnt, mIdx in ((mask_cnt, mask_idx), (full_cnt, full_idx)):
            # B or H extent 1 broadcasts (the host checks the extent is 1 or the call's)
            bb = cutlass.min(batch, mCnt.shape[0] - 1)
            hh = cutlass.min(head, mCnt.shape[1] - 1)
            qq = _clamp(qb, 0, mCnt.shape[2] - 1)
            count = _clamp(Int32(mCnt[bb, hh, qq]), 0, mIdx.shape[3])
            rows.append((mIdx[bb, hh, qq, None], count))
        return SparseBlockInfo(block.tile_m, block.tile_n, block.windowed, block.seq, block.window_left,
                               block.window_right, block.pack, kv_ratio, rows[0][0], rows[1][0], rows[0][1],
                               rows[1][1])

    @cute.jit
    def kv_plan(self, m_block: Int32):
        """(0, F + M, M, F, 0) in virtual tiles: M mask tiles on top (visited first), F full tiles below."""
        n_mask = self.n_mask * self.kv_ratio
        n_full = self.n_full * self.kv_ratio
        return Int32(0), n_full + n_mask, n_mask, n_full, Int32(0)

    def kv_range(self, m_block: Int32):
        raise NotImplementedError("a block-sparse schedule is walked through kv_plan / tile_of (the dQ kernel "
                                  "does), not as a contiguous range")

    @cute.jit
    def tile_of(self, t: Int32) -> Int32:
        """The real KV tile of virtual tile ``t`` (see the module docstring)."""
        kr = self.kv_ratio
        n_full = self.n_full * kr
        blk = Int32(0)
        sub = Int32(0)
        if t < n_full:
            blk = Int32(self.full_row[t // kr])
            sub = t % kr
        else:
            u = t - n_full
            blk = Int32(self.mask_row[u // kr])
            sub = u % kr
        kv_block = self.tile_n * kr
        n_blocks = (self.seq.seqlen_k + kv_block - 1) // kv_block  # KV blocks of this sequence
        return _clamp(blk, 0, n_blocks) * kr + sub

    @cute.jit
    def next_tile(self, t: Int32, prev: Int32) -> Int32:
        """``tile_of(t)`` from ``prev = tile_of(t - 1)``: the next KV tile of the same listed block (no load)
        unless ``t`` starts a block (F is a multiple of kv_ratio, so a block starts where ``t % kv_ratio == 0``)."""
        tile = prev + 1
        if const_expr(self.kv_ratio == 1):
            tile = self.tile_of(t)
        else:
            if t % self.kv_ratio == 0:
                tile = self.tile_of(t)
        return tile

    @cute.jit
    def run_kv_schedule(self, step, state, plan):
        """Mask tiles (causal/window masks when windowed, and the mask_mod), then full tiles (no mask_mod).  The
        sequence-end mask goes on every windowed mask tile and otherwise only on a tile that reaches past
        seqlen_k, which a listed tile may: the test is uniform over the CTA, and an interior tile then runs the
        step without it.  No step is
        ``is_first``: the softmax state starts at (-inf, 0, O = 0), which a non-first step handles."""
        _, total, n_mask, n_full, _ = plan
        windowed = self.windowed
        for i in cutlass.range(n_mask, unroll=1):
            t = total - 1 - i
            if const_expr(windowed):
                state = step(t, state, is_first=False, mask_seqlen=True, mask_right=True, mask_left=True)
            else:  # no causal/window mask: as a full tile, but with the mask_mod (when the call has one)
                if (self.tile_of(t) + 1) * self.tile_n <= self.seq.seqlen_k:
                    state = step(t, state, is_first=False, mask_seqlen=False, mask_right=False, mask_left=False)
                else:
                    state = step(t, state, is_first=False, mask_seqlen=True, mask_right=False, mask_left=False)
        for i in cutlass.range(n_full, unroll=1):
            t = n_full - 1 - i
            if (self.tile_of(t) + 1) * self.tile_n <= self.seq.seqlen_k:
                state = step(t, state, is_first=False, mask_seqlen=False, mask_right=False, mask_left=False,
                             mask_mod_on=False)
            else:
                state = step(t, state, is_first=False, mask_seqlen=True, mask_right=False, mask_left=False,
                             mask_mod_on=False)
        return state


@dataclass(frozen=True)
class SparseQList:
    """The query tiles one dK/dV CTA (KV tile ``n_block`` of KV head ``kv_head``) visits, from the KV-major lists
    (host: block_sparse.transpose_block_sparse):
        mask_cnt[b, h, kb], mask_idx[b, h, kb, :]   query blocks that see KV block kb through the masks
        full_cnt[b, h, kb], full_idx[b, h, kb, :]   query blocks that see it whole
    per query head h.  The CTA walks the heads of its group in order, for each its mask blocks then its full
    blocks, each block expanded to ``q_ratio`` query tiles: a flat, fixed order (so dK/dV are bitwise
    reproducible) whose i-th entry ``locate`` finds by a walk over the group's counts (a few cached loads; the
    group is small), so the kernel's prefetch of "the next query tile" works unchanged; ``next_entry`` steps from
    one entry to the next and walks only where a new block starts.  Only the per-head views
    of the CTA's (batch, KV block) are kept (fewer live registers than the 4-D tensors).

    Counts are clamped to [0, width], the KV block to the rows of the count tensor, query blocks to
    [0, ceil(seqlen_q / q_block)] (one past the end reads nothing: its rows are zero-filled and get P = 0)."""

    q_ratio: int
    mask_cnt: cute.Tensor  # (H,) counts of the CTA's batch entry and KV block
    mask_idx: cute.Tensor  # (H, width)
    full_cnt: cute.Tensor
    full_idx: cute.Tensor
    first_head: Int32
    group: Int32
    n_q_blocks: Int32  # user query blocks of the sequence

    @staticmethod
    @cute.jit
    def create(q_ratio: cutlass.Constexpr[int], kv_ratio: cutlass.Constexpr[int], tile_m: cutlass.Constexpr[int],
               sparse, batch, first_head, group, n_block, seqlen_q) -> "SparseQList":
        views = []
        mask_cnt, mask_idx, full_cnt, full_idx = sparse  # the KV-major lists (arguments.BlockSparseLists)
        for mCnt, mIdx in ((mask_cnt, mask_idx), (full_cnt, full_idx)):
            # B extent 1 broadcasts; the H extent is clamped per head in _count
            bb = cutlass.min(batch, mCnt.shape[0] - 1)
            kk = _clamp(n_block // kv_ratio, 0, mCnt.shape[2] - 1)
            views.append(mCnt[bb, None, kk])
            views.append(mIdx[bb, None, kk, None])
        q_block = tile_m * q_ratio
        return SparseQList(q_ratio, views[0], views[1], views[2], views[3], first_head, group,
                           (seqlen_q + q_block - 1) // q_block)

    @cute.jit
    def _count(self, cnt, idx, g):
        """(row, clamped count) of query head ``first_head + g`` (an H extent of 1 broadcasts)."""
        hh = cutlass.min(self.first_head + g, cnt.shape[0] - 1)
        return hh, _clamp(Int32(cnt[hh]), 0, idx.shape[1])

    @cute.jit
    def num_tiles(self) -> Int32:
        """Query tiles to visit, over every head of the group."""
        n = Int32(0)
        for g in cutlass.range(self.group, unroll=1):
            n = n + self._count(self.mask_cnt, self.mask_idx, g)[1] + self._count(self.full_cnt, self.full_idx, g)[1]
        return n * self.q_ratio

    @cute.jit
    def locate(self, it: Int32):
        """(query head, query tile, 1 for a mask block / 0 for a full block) of flat entry ``it``; an ``it`` past
        the end gives (first_head, 0, 0) (never used: the kernel only prefetches entries that exist)."""
        blk = it // self.q_ratio
        sub = it % self.q_ratio
        rem = blk
        found = Int32(0)
        head = self.first_head
        qb = Int32(0)
        is_mask = Int32(0)
        for g in cutlass.range(self.group, unroll=1):
            mh, cm = self._count(self.mask_cnt, self.mask_idx, g)
            fh, cf = self._count(self.full_cnt, self.full_idx, g)
            if found == 0:
                if rem < cm:
                    head = self.first_head + g
                    qb = Int32(self.mask_idx[mh, rem])
                    is_mask = Int32(1)
                    found = Int32(1)
                else:
                    if rem < cm + cf:
                        head = self.first_head + g
                        qb = Int32(self.full_idx[fh, rem - cm])
                        found = Int32(1)
                    else:
                        rem = rem - cm - cf
        return head, _clamp(qb, 0, self.n_q_blocks) * self.q_ratio + sub, is_mask

    @cute.jit
    def next_entry(self, it: Int32, head: Int32, m_block: Int32, is_mask: Int32):
        """Entry ``it`` from entry ``it - 1`` = (head, m_block, is_mask): the next query tile of the same block
        (no load) unless ``it`` starts a block, which ``locate`` finds (the same values ``locate(it)`` gives)."""
        if const_expr(self.q_ratio == 1):
            head, m_block, is_mask = self.locate(it)
        else:
            m_block = m_block + 1
            if it % self.q_ratio == 0:
                head, m_block, is_mask = self.locate(it)
        return head, m_block, is_mask
