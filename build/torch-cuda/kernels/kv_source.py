"""K/V address provider (CuTe-DSL device code, trace time): where the keys and values of one (batch, KV head)
live.  Every kernel reads K/V through one of these, so a new storage (paged KV: rows scattered over pages by a
page table) is a new provider, not a change in five kernels.

``ContiguousKV``: k/v are (B, Sk, Hkv, D) or varlen (total_k, Hkv, D); the rows of one sequence are contiguous,
starting at ``SeqInfo.offset_k`` (clamped to the tensor).

``PagedKV``: k/v are (num_pages, page_size, Hkv, D) (any strides with a contiguous last dim, e.g. one half of a
fused (2, num_pages, ...) cache); key ``pos`` of batch entry b is row ``pos % page_size`` of page
``page_table[b, pos // page_size]``.  Any page size works in the cp.async kernel (rows are addressed one by one,
so a K/V tile may span several pages).  The TMA kernel runs paged calls whose page size is a multiple of its
tile_n (every K/V tile inside one page: ``tma_box``), with one TMA box per tile from a descriptor over the pool
viewed as (page_size, D, Hkv, num_pages).  Page indices are the caller's contract, as in FlashAttention: they are
clamped to [0, num_pages - 1], so a wrong one reads a wrong page but never outside the pool.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class ContiguousKV:
    seq: SeqInfo

    def head_view(self, mX: cute.Tensor, kv_head) -> cute.Tensor:
        """(Sk, D) view of one KV head of this sequence: row i is key i (for cp.async tiles)."""
        seq = self.seq
        if const_expr(seq.varlen_k):
            return cute.domain_offset((seq.offset_k, 0), mX[None, kv_head, None])
        return mX[seq.batch, None, kv_head, None]

    def tma_head_view(self, tX: cute.Tensor, kv_head) -> cute.Tensor:
        """The same view of a TMA coordinate tensor laid out (seq, D, head[, batch]); TMA zero-fills rows past
        the end of the tensor."""
        seq = self.seq
        if const_expr(seq.varlen_k):
            return cute.domain_offset((seq.offset_k, 0), tX[None, None, kv_head])
        return tX[None, None, kv_head, seq.batch]

    def row(self, mX: cute.Tensor, pos, kv_head) -> cute.Tensor:
        """(D,) row of key ``pos`` (0 <= pos < seqlen_k)."""
        return self.seq.k_row(mX, pos, kv_head)


@dataclass(frozen=True)
class PagedKV:
    seq: SeqInfo
    page_table: cute.Tensor  # (B, max_pages_per_seq) int32
    # the runtime page size: an Int32, or (``fast``) a multiply-shift divisor, which saves ~20 instructions per
    # row address but holds two more registers for the whole kernel (it spills the one-stage d >= 192 tiles)
    page_size: object
    last_page: Int32  # num_pages - 1

    @staticmethod
    def create(seq: SeqInfo, mK: cute.Tensor, mPageTable: cute.Tensor, fast: bool = False) -> "PagedKV":
        size = Int32(mK.shape[1])
        return PagedKV(seq, mPageTable, cute.fast_divmod_create_divisor_v2(size) if fast else size,
                       Int32(mK.shape[0]) - 1)

    def row(self, mX: cute.Tensor, pos, kv_head) -> cute.Tensor:
        """(D,) row of key ``pos`` (0 <= pos < seqlen_k <= max_pages_per_seq * page_size, so the column of the
        page table is in range)."""
        col = pos // self.page_size
        page = cutlass.min(cutlass.max(self.page_table[self.seq.batch, col], 0), self.last_page)
        return mX[page, pos % self.page_size, kv_head, None]

    @staticmethod
    def create_tma(seq: SeqInfo, tX: cute.Tensor, mPageTable: cute.Tensor) -> "PagedKV":
        """From the TMA coordinate view of the pool, (page_size, D, Hkv, num_pages) (the TMA kernel's producer warp
        builds its own, so nothing of the page lookup is live in the consumer warps)."""
        return PagedKV(seq, mPageTable, Int32(tX.shape[0]), Int32(tX.shape[3]) - 1)

    def tma_box(self, n_block, tile_n: int):
        """(page, box) of K/V tile ``n_block`` (>= 0) when every tile lies inside one page (page_size % tile_n ==
        0, checked by the host): its rows are box ``box`` of ``tile_n`` rows of page
        ``page_table[batch, n_block * tile_n // page_size]``.  The table column and the page are clamped (a wrong
        entry reads a wrong page, never outside the pool; a box past a page's end would be zero-filled by TMA)."""
        pos = n_block * tile_n
        col = pos // self.page_size
        safe_col = cutlass.min(cutlass.max(col, 0), Int32(self.page_table.shape[1]) - 1)
        page = cutlass.min(cutlass.max(self.page_table[self.seq.batch, safe_col], 0), self.last_page)
        return page, (pos - col * self.page_size) // tile_n

    def page_of(self, pos):
        """The (clamped) page holding key ``pos``; any ``pos`` is safe (it and the table column are clamped), so
        it can be read ahead for a block that may not be loaded (kernels issue these loads early to hide their
        latency, see fwd_cpasync.prefetch_pages)."""
        col = cutlass.min(cutlass.max(pos, 0) // self.page_size, Int32(self.page_table.shape[1]) - 1)
        return cutlass.min(cutlass.max(self.page_table[self.seq.batch, col], 0), self.last_page)

    def row_in(self, mX: cute.Tensor, page, pos, kv_head) -> cute.Tensor:
        """(D,) row of key ``pos`` (>= 0) whose page (``page_of(pos)``) is already known."""
        return mX[page, pos % self.page_size, kv_head, None]
