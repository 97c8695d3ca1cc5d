"""The state every kernel builds first, one implementation for the forward and both backward kernels: the
sequence bounds of its batch entry (``SeqInfo``, clamped to the tensors), its block schedule (``BlockInfo``), the
score hook (``ScoreHook``, holding its ``Mask`` and ``Dropout`` components) and the K/V source (``ContiguousKV``).
A kernel class mixes in ``KernelStateMixin``; a variant changes the schedule or the K/V storage by overriding
``block_info_cls`` / ``kv_source_cls``.
"""

from dataclasses import dataclass

from cutlass import const_expr

from .block_info import BlockInfo, SplitBlockInfo
from .kv_source import ContiguousKV, PagedKV
from .philox import DropoutRng
from .score import ScoreHook
from .score_dropout import Dropout
from .score_mask import Mask
from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class KernelState:
    seq: SeqInfo
    block: BlockInfo
    score: ScoreHook
    kv: ContiguousKV


class KernelStateMixin:
    """Needs ``self.cfg``, ``self.tile_m``, ``self.tile_n``."""

    block_info_cls = BlockInfo
    kv_source_cls = ContiguousKV
    # dropout: every thread's first S-accumulator column is even and < 8 mod 16 (true when warps are stacked
    # along M), so one Philox call serves 4 of its elements (kernels/philox.py); else one call per column pair
    dropout_quad_ok = True
    # dropout: make a tile's keep bits one row per loop iteration (Dropout.bits); a kernel may turn it
    # off where the compile gate measured fewer registers unrolled
    dropout_row_loop = True
    # dropout: make a row pair's Philox calls one per iteration of a loop that is not unrolled (Dropout._pair_rows);
    # a kernel turns it on where the unrolled calls spill (measured by the compile gate)
    dropout_group_loop = False

    def seq_rows(self, mQ, mK, mPageTable=None):
        """Sequence extent of q and k as given: total rows when varlen, else Sq / Sk; with a page table (paged
        K/V), max_pages_per_seq * page_size (the host checks that it fits int32)."""
        cfg = self.cfg
        rows_q = mQ.shape[1]
        rows_k = mK.shape[1]
        if const_expr(cfg.varlen_q):
            rows_q = mQ.shape[0]
        if const_expr(cfg.varlen_k):
            rows_k = mK.shape[0]
        if const_expr(self.is_paged()):
            rows_k = mPageTable.shape[1] * mK.shape[1]
        return rows_q, rows_k

    def wants_raw_scores(self) -> bool:
        """A backward kernel keeps the scaled scores before the score_mod (its score_mod_bwd reads them)."""
        mods = getattr(self.cfg, "mods", None)
        return mods is not None and mods.score_mod is not None

    def has_mask_mod(self) -> bool:
        mods = getattr(self.cfg, "mods", None)
        return mods is not None and mods.mask_mod is not None

    def is_paged(self) -> bool:
        return getattr(self.cfg, "paged", False)  # backward configs have no paged flag

    def kv_source(self, seq: SeqInfo, mK, mPageTable):
        """The K/V address provider: ``PagedKV`` when the config is paged, else ``kv_source_cls``."""
        if const_expr(self.is_paged()):
            # the fast page divisor on the pipelined tiles only (see PagedKV.page_size)
            return PagedKV.create(seq, mK, mPageTable, fast=getattr(self, "num_stages", 1) > 1)
        return self.kv_source_cls(seq)

    def kernel_state(self, batch, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, scale_log2,
                     softcap_prescale, window_left, window_right, pack, mK=None, mPageTable=None,
                     split=None, dropout=None, aux=None) -> KernelState:
        """``pack``: query rows per position in a tile (packed GQA in the forward), 1 for the backward.
        ``mK``/``mPageTable``: needed by a paged configuration only.  ``split``: (split index, number of splits) of
        a split-KV forward (its KV range comes from SplitBlockInfo), else None.  ``dropout``: the kernel's dropout
        arguments (an arguments.DropoutParams), None when the config has no dropout.  ``aux``: the mods' aux tensors (a tuple) when the config has mods."""
        cfg = self.cfg
        seq = SeqInfo.create(cfg, batch, rows_q, rows_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK)
        if const_expr(split is not None):
            block = SplitBlockInfo(self.tile_m, self.tile_n, cfg.windowed, seq, window_left, window_right, pack,
                                   *split)
        else:
            block = self.block_info_cls(self.tile_m, self.tile_n, cfg.windowed, seq, window_left, window_right,
                                        pack)
        drop = None
        if const_expr(cfg.has_dropout):
            drop = Dropout.create(cfg, self.tile_n, DropoutRng.create(*dropout), self.dropout_quad_ok,
                                  self.dropout_row_loop, self.dropout_group_loop)
        mask = Mask.create(cfg, self.tile_n, seq, window_left, window_right, aux)
        score = ScoreHook.create(cfg, scale_log2, softcap_prescale, mask, drop)
        return KernelState(seq, block, score, self.kv_source(seq, mK, mPageTable))
