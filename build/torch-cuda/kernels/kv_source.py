"""K/V address provider (CuTe-DSL device code, trace time): where the keys and values of one (batch, KV head)
live.  Every kernel reads K/V through one of these, so a new storage (paged KV: rows scattered over pages by a
page table) is a new provider, not a change in five kernels.

``ContiguousKV``: k/v are (B, Sk, Hkv, D) or varlen (total_k, Hkv, D); the rows of one sequence are contiguous,
starting at ``SeqInfo.offset_k`` (clamped to the tensor).
"""

from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import const_expr

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
