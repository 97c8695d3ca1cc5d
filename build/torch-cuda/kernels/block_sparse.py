"""Block-sparse KV schedule (CuTe-DSL device code, trace time): the forward visits only the KV blocks listed for
its query block, instead of the contiguous range of ``BlockInfo``.

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
[0, width of the index tensor], indices to [0, ceil(seqlen_k / kv_block)] (one past the end is allowed: every
load is predicated on the sequence end, so such a block reads nothing and is masked whole), and the query block
to the rows of the count tensor.  Every sparse step masks the sequence end (a listed block may be the partial
last one, or lie past a short varlen sequence).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

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
    def from_block(block: BlockInfo, q_ratio: cutlass.Constexpr[int], kv_ratio: cutlass.Constexpr[int], mMaskCnt,
                   mMaskIdx, mFullCnt, mFullIdx, batch, head, m_block) -> "SparseBlockInfo":
        qb = m_block // q_ratio
        rows = []
        for mCnt, mIdx in ((mMaskCnt, mMaskIdx), (mFullCnt, mFullIdx)):
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
        raise NotImplementedError("the block-sparse schedule is forward-only (no dQ kernel walks it yet)")

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
    def run_kv_schedule(self, step, state, plan):
        """Mask tiles (sequence end + causal/window masks when windowed), then full tiles (sequence end only).
        No step is ``is_first``: the softmax state starts at (-inf, 0, O = 0), which a non-first step handles."""
        _, total, n_mask, n_full, _ = plan
        windowed = self.windowed
        for i in cutlass.range(n_mask, unroll=1):
            state = step(total - 1 - i, state, is_first=False, mask_seqlen=True, mask_right=windowed,
                         mask_left=windowed)
        for i in cutlass.range(n_full, unroll=1):
            state = step(n_full - 1 - i, state, is_first=False, mask_seqlen=True, mask_right=False,
                         mask_left=False)
        return state
