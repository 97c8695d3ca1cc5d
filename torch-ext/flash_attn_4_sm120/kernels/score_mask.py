"""The mask component of the score hook (CuTe-DSL device code, trace time): where a tile's scores lie (sequence
bounds, the query head of each row, the (query, key) view of transposed accumulators) and which of them are masked
(sequence end, causal / sliding window, the user's mask_mod, block-sparse gating).  ``score.ScoreHook`` holds one
``Mask`` and calls ``Mask.apply`` after its score transform (softcap or score_mod), in the forward and in both
backward kernels alike.

Mask conventions: see block_info.py.  Only boundary blocks are masked (the caller says which masks a block needs,
as compile-time flags); the inner loop is one integer compare + select per element.
"""

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..config import WINDOW_UNBOUNDED
from .cute_utils import acc_mn_view
from .seqlen_info import SeqInfo


@dataclass(frozen=True)
class Mask:
    """Window bounds and the diagonal offset as runtime values, flags as compile-time values.  Build it with
    ``Mask.create(cfg, ...)``."""

    windowed: bool
    tile_n: int
    seq: SeqInfo
    window_left: Int32
    window_right: Int32
    diag: Int32  # seqlen_k - seqlen_q: query i's diagonal key is i + diag (bottom-right alignment)
    # the user's mask_mod (compile-time; None when off) and the mods' aux tensors (a tuple of cute tensors, None
    # without mods): with aux tensors, mod indices past the sequence ends are clamped to the last position (the
    # score_mod of score.py clamps the same way)
    mask_mod: object = None
    aux: object = None
    # forward only: (first tile row, first head of the group, pack) to map packed tile rows to query heads
    head_rows: object = None
    # block sparsity: whether the mask_mod applies to this block (a runtime value: True on "mask" blocks, False on
    # "full" ones, which skip it as upstream's do; ``for_sparse_block``; a mod without aux tensors is evaluated on
    # both and its verdict dropped on "full" ones, ``branches_on_gate``), None = always
    gate: object = None
    # the accumulators hold S^T (keys as the mma rows: the key-row dK/dV kernel, bwd_dkdv_kvrows.py); ``mn`` then
    # views them as (query, key) all the same, so every method indexes [query row, key column]
    transposed: bool = False
    # block-sparse backward tiles: put a mask_mod that reads no aux tensor behind a branch on ``gate`` too (as
    # one that reads aux tensors always is), so "full" tiles skip its integer work (measured faster in the key-row
    # dK/dV kernel and slower in the dQ kernel, d128 S=16K causal as a block mask: not used there)
    gate_branch: bool = False

    @staticmethod
    def create(cfg, tile_n: int, seq: SeqInfo, window_left, window_right, aux=None) -> "Mask":
        mods = getattr(cfg, "mods", None)
        return Mask(cfg.windowed, tile_n, seq, window_left, window_right, seq.seqlen_k - seq.seqlen_q,
                    mask_mod=mods.mask_mod if mods is not None else None, aux=aux if mods is not None else None)

    def mn(self, acc: cute.Tensor) -> cute.Tensor:
        """An accumulator (or its coordinates) as [query row, key column] (``acc_mn_view``, transposed for S^T)."""
        v = acc_mn_view(acc)
        if const_expr(self.transposed):
            v = cute.make_tensor(v.iterator, cute.select(v.layout, mode=[1, 0]))
        return v

    @cute.jit
    def for_sparse_block(self, masked, gate_branch: cutlass.Constexpr[bool] = False) -> "Mask":
        """The mask of one block-sparse tile: the call's window on a mask block, an unbounded one on a full block
        (only the sequence end is masked then); the mask_mod on mask blocks only.  A runtime choice of bounds, so
        the kernel keeps one masking code path (two compiled variants behind a branch cost the d=256 dK/dV tile its
        registers).  ``gate_branch``: see the field."""
        left = Int32(WINDOW_UNBOUNDED)
        right = Int32(WINDOW_UNBOUNDED)
        if masked:
            left = self.window_left
            right = self.window_right
        gate = None
        if const_expr(self.mask_mod is not None):
            gate = cutlass.Boolean(masked)
        return replace(self, window_left=left, window_right=right, gate=gate, gate_branch=gate_branch)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor,
              n_block: Int32, mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
              mask_left: cutlass.Constexpr[bool], row_head=None, mask_mod_on: cutlass.Constexpr[bool] = True):
        """Masked entries of the (transformed) scores to -inf.  ``row_qpos``: query position of each of this
        thread's rows; ``tScS_mn``/``t0ScS_mn``: (row, col) coordinates of this thread's / thread 0's accumulator
        elements; ``row_head``: see ``row_head``.  A mask_mod applies to every block it is called on, except with
        ``mask_mod_on=False`` (the forward's block-sparse "full" tiles) or a false ``gate`` (the backward's)."""
        with_mod = const_expr(self.mask_mod is not None and mask_mod_on)
        if const_expr(with_mod and self.branches_on_gate()):
            # the mod alone behind the branch, the masks after it for every tile: fusing the sequence end into
            # the branch puts it in both arms, which costs the full tiles (most of them) more than it saves
            if self.gate:
                self.mask_with_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, False, False)
            if const_expr(mask_seqlen or mask_right or mask_left):
                self.bounds(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)
        elif const_expr(with_mod):
            self.mask_mod_and_bounds(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, mask_seqlen,
                                     mask_right, mask_left, self.gate is not None)
        elif const_expr(mask_seqlen or mask_right or mask_left):
            self.bounds(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)

    @cute.jit
    def mask_mod_and_bounds(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block,
                            mask_seqlen: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
                            mask_left: cutlass.Constexpr[bool], gated: cutlass.Constexpr[bool]):
        """The mask_mod and the masks: the sequence-end mask joins the mod's pass (``mask_with_mod``); causal /
        window masks run after it as their own pass (``bounds``), as fusing their bounds in too costs the d128
        dK/dV tile with a windowed aux-reading mod its last registers (spills)."""
        fuse = const_expr(not (mask_right or mask_left))
        self.mask_with_mod(acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block, mask_seqlen and fuse, gated)
        if const_expr(not fuse):
            self.bounds(acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen, mask_right, mask_left)

    def branches_on_gate(self) -> bool:
        """Trace time: whether a block-sparse backward tile (a runtime ``gate``) puts its mask_mod behind a
        branch on the gate: when the mods read aux tensors, so "full" tiles issue none of the mod's loads.  A mod
        without aux tensors reads no memory: it runs on every tile, the gate joining its predicate
        (``mask_with_mod``), and no branch splits the tile's code."""
        return self.gate is not None and (self.aux is not None or self.gate_branch)

    @cute.jit
    def mask_with_mod(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, row_head, n_block,
                      mask_seqlen: cutlass.Constexpr[bool], gated: cutlass.Constexpr[bool]):
        """The mask_mod, and with ``mask_seqlen`` the sequence-end mask, in one pass: an element is dropped when
        the mod does not keep it or it lies past seqlen_k, one select per element (not one per pass).
        ``mask_mod(b, h, q_idx, kv_idx, seqlen_info, aux_tensors)`` gets size-1 Int32 vectors (True = keep), the
        indices logical and clamped with aux tensors as for the score_mod (score.py).
        ``gated``: the mod's verdict counts only where ``gate`` is true (``branches_on_gate``: a mod without
        aux tensors on a block-sparse backward tile), in place of a branch around the mod: no branch splits the
        tile's code, so ptxas interleaves the mod's integer work with the mma that follows (what the causal /
        window masks of ``for_sparse_block`` already get from runtime bounds).  Such a mod reads no memory, so
        running it on a "full" tile only spends a few integer instructions there."""
        s_mn = self.mn(acc_S)
        nrow = const_expr(cute.size(s_mn, mode=[0]))
        ncol = const_expr(cute.size(s_mn, mode=[1]))
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        hi = self.seq.seqlen_k - col_base
        clamp = const_expr(self.aux is not None)
        q_last = cutlass.max(self.seq.seqlen_q - 1, 0)
        k_last = cutlass.max(self.seq.seqlen_k - 1, 0)
        aux = self.aux if const_expr(self.aux is not None) else ()
        b_ssa = ssa(self.seq.batch)
        for r in cutlass.range_constexpr(nrow):
            q = row_qpos[r]
            if const_expr(clamp):
                q = cutlass.min(q, q_last)
            h = ssa(self.row_head(tScS_mn, r, row_head))
            q_ssa = ssa(q)
            for c in cutlass.range_constexpr(ncol):
                col = t0ScS_mn[0, c][1]
                k = col_base + col
                if const_expr(clamp):
                    k = cutlass.min(k, k_last)
                keep = self.mask_mod(b_ssa, h, q_ssa, ssa(k), self.seq, aux)
                # bitwise on i1 (``and``/``or`` lower to chains of selects)
                drop = ~cutlass.Boolean(keep[0])
                if const_expr(gated):
                    drop = drop & self.gate
                if const_expr(mask_seqlen):
                    drop = drop | (col >= hi)
                if drop:
                    s_mn[r, c] = -Float32.inf

    @cute.jit
    def row_head(self, tScS_mn, r: cutlass.Constexpr[int], row_head):
        """Query head of this thread's row ``r``: ``row_head`` when given (the backward's one head), else from the
        forward tile's (first row, first head, pack): a packed row is (position, head-in-group)."""
        if const_expr(row_head is not None):
            return row_head
        row0, head0, pack = self.head_rows
        row = row0 + tScS_mn[r, 0][0]
        return head0 + row - (row // pack) * pack

    @cute.jit
    def bounds(self, acc_S, tScS_mn, t0ScS_mn, row_qpos, n_block, mask_seqlen: cutlass.Constexpr[bool],
               mask_right: cutlass.Constexpr[bool], mask_left: cutlass.Constexpr[bool]):
        """The sequence-end, causal and window masks.  Columns are compared as compile-time offsets of thread 0
        against limits shifted by this thread's first column."""
        seqlen_k = self.seq.seqlen_k
        diag = self.diag
        s_mn = self.mn(acc_S)
        col0 = tScS_mn[0, 0][1]
        col_base = n_block * self.tile_n + col0
        seq_hi = seqlen_k - col_base
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            hi = seq_hi
            lo = Int32(0)
            if const_expr(mask_right or mask_left):
                key_aligned = row_qpos[r] + diag - col_base
                if const_expr(mask_right):
                    hi = key_aligned + self.window_right + 1
                    if const_expr(mask_seqlen):
                        hi = cutlass.min(hi, seq_hi)
                if const_expr(mask_left):
                    lo = key_aligned - self.window_left
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                col = t0ScS_mn[0, c][1]
                if const_expr(mask_left):
                    if col >= hi or col < lo:
                        s_mn[r, c] = -Float32.inf
                elif const_expr(mask_seqlen or mask_right):
                    if col >= hi:
                        s_mn[r, c] = -Float32.inf


@cute.jit
def ssa(x, n: cutlass.Constexpr[int] = 1):
    """A scalar as a TensorSSA of ``n`` equal Int32 values (the index arguments of a mod)."""
    t = cute.make_rmem_tensor(n, Int32)
    for i in cutlass.range_constexpr(n):
        t[i] = x
    return t.load()
