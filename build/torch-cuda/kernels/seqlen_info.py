"""Sequence info of one batch entry (CuTe-DSL device code, trace time): offsets and lengths of q and k, clamped
to the tensors the kernel was given.

Metadata the host cannot check without a device->host copy (``cu_seqlens``, ``seqused``) is the caller's
contract, as in FlashAttention.  The kernels never trust it with an address: every bound is clamped here, once,
to the rows of the tensor it indexes, so a lying value can give wrong numbers but never reads or writes outside
the tensors:

    varlen:   start = clamp(cu[b], 0, rows),  end = clamp(cu[b + 1], start, rows),  seqlen = end - start
    dense:    seqlen = rows (the tensor's sequence extent)
    seqused:  seqlen = clamp(seqused[b], 0, seqlen)

Every kernel (both forwards, both backward kernels) builds its sequence bounds with ``SeqInfo.create`` and reads
and writes rows through ``q_row``/``k_row``, so the clamp cannot be forgotten by one of them.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def _clamp(x, lo, hi):
    return cutlass.min(cutlass.max(x, lo), hi)


@dataclass(frozen=True)
class SeqInfo:
    """Bounds of batch entry ``batch``: ``offset_q``/``offset_k`` (first row in a varlen tensor, else 0) and
    ``seqlen_q``/``seqlen_k`` (rows of this entry, seqused applied).  Frozen: the DSL passes read-only frozen
    dataclasses through dynamic control flow unchanged."""

    batch: Int32
    offset_q: Int32
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    varlen_q: bool
    varlen_k: bool

    @staticmethod
    def create(cfg, batch, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK) -> "SeqInfo":
        """``rows_q``/``rows_k``: the sequence extent of q/k as given (total rows when varlen, else Sq/Sk)."""
        offset_q, seqlen_q = SeqInfo._bounds(cfg.varlen_q, cfg.seqused_q, batch, rows_q, mCuSeqlensQ, mSeqUsedQ)
        offset_k, seqlen_k = SeqInfo._bounds(cfg.varlen_k, cfg.seqused_k, batch, rows_k, mCuSeqlensK, mSeqUsedK)
        return SeqInfo(batch, offset_q, offset_k, seqlen_q, seqlen_k, cfg.varlen_q, cfg.varlen_k)

    @staticmethod
    def _bounds(varlen: bool, seqused: bool, batch, rows, mCu, mUsed):
        rows = Int32(rows)
        offset = Int32(0)
        seqlen = rows
        if const_expr(varlen):
            offset = _clamp(mCu[batch], 0, rows)
            seqlen = _clamp(mCu[batch + 1], offset, rows) - offset
        if const_expr(seqused):
            seqlen = _clamp(mUsed[batch], 0, seqlen)
        if const_expr(varlen or seqused):
            # the same for every thread of the CTA: keep them in uniform registers, off the mma warps' budget
            offset = cute.arch.make_warp_uniform(offset)
            seqlen = cute.arch.make_warp_uniform(seqlen)
        return offset, seqlen

    @cute.jit
    def unused_q_positions(self, batch, num_batch, rows_q, mCuSeqlensQ):
        """(tail, lead): the rows of q this entry owns that no query uses.  An entry owns the rows from its start
        to the next entry's start (the last entry: to the end of q); the ``tail`` ones past its (seqused) length
        are positions seqlen_q .. seqlen_q + tail - 1, and the first entry also owns the ``lead`` rows before its
        start (positions -lead .. -1).  Dense q without seqused has none.  Clamped like the bounds above."""
        rows = Int32(rows_q)
        own_end = rows - self.offset_q
        lead = Int32(0)
        if const_expr(self.varlen_q):
            if batch + 1 < num_batch:
                own_end = _clamp(mCuSeqlensQ[batch + 1], self.offset_q, rows) - self.offset_q
            if batch == 0:
                lead = self.offset_q
        return own_end - self.seqlen_q, lead

    # ---- addressing: every gmem row of q/o/dq/do (q side) and k/v/dk/dv (k side) goes through these
    def q_row(self, mX: cute.Tensor, pos, head) -> cute.Tensor:
        """The (D,) row of query position ``pos`` (0 <= pos < seqlen_q) of ``head``."""
        if const_expr(self.varlen_q):
            return mX[self.offset_q + pos, head, None]
        return mX[self.batch, pos, head, None]

    def k_row(self, mX: cute.Tensor, pos, head) -> cute.Tensor:
        if const_expr(self.varlen_k):
            return mX[self.offset_k + pos, head, None]
        return mX[self.batch, pos, head, None]

    def row_stat_index(self, head, pos):
        """Index of query ``pos`` of ``head`` in a per-row fp32 tensor (LSE, D): (Hq, total_q) or (B, Hq, Sq)."""
        if const_expr(self.varlen_q):
            return (head, self.offset_q + pos)
        return (self.batch, head, pos)
