"""The dropout component of the score hook (CuTe-DSL device code, trace time): the Philox parameters of a kernel
(``DropoutRng``), the keep bits of an S tile from the Philox function of (seed, offset, b, h, i, j)
(kernels/philox.py; the contract is stated in dropout.py) and their application to the forward's 16-bit P tile.
``score.ScoreHook`` holds one ``Dropout`` (None without dropout); the backward's dS / P * keep read its keep bits
through the hook's P path (``ScoreHook.backward_ds`` / ``backward_p_ds``).
"""

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr

from .cute_utils import acc_mn_view, lt_abs_mask_f16x2
from ..dropout import KEEP_BITS
from .philox import DropoutRng, column_groups, row_pairs


VALUE_MASK = (1 << KEEP_BITS) - 1  # an element's random value: the low KEEP_BITS bits of its 16-bit half


def _lo(w: Uint32) -> Uint32:
    """The random value of a word's low half (LOP3)."""
    return w & Uint32(VALUE_MASK)


def _hi(w: Uint32) -> Uint32:
    """The random value of a word's high half, left where it is (value << 16; one LOP3): compared with
    ``t << 16`` (``_t_hi``), which needs no shift of the value."""
    return w & Uint32(VALUE_MASK << 16)


def _t_hi(t: Uint32) -> Uint32:
    """The threshold for ``_hi`` values (loop-invariant)."""
    return t << Uint32(16)


def _shift_pair(lo: Uint32, hi: Uint32, n: int, row: Uint32, at: int):
    """Trace time: the 64-bit shift register (hi:lo) moved down ``n`` bits (0 < n <= 32), then ``row`` (n bits)
    ORed in at bit ``at`` (at + n <= 64), in 32-bit halves.  A loop-carried Uint64 register here gave wrong high
    words on the H100 (packed GQA rows on the 128-key tile; benchmarks/experiments/results/packed_dropout_probe_h100_s31.log)."""
    if n == 32:
        lo, hi = hi, Uint32(0)
    else:
        lo, hi = (lo >> Uint32(n)) | (hi << Uint32(32 - n)), hi >> Uint32(n)
    if at >= 32:
        hi = hi | (row << Uint32(at - 32)) if at > 32 else hi | row
    else:
        lo = lo | (row << Uint32(at)) if at > 0 else lo | row
        if at + n > 32:
            hi = hi | (row >> Uint32(32 - at))
    return lo, hi


def _regular_step(groups):
    """Trace time: the column step between consecutive Philox groups when they are evenly spaced, of one kind,
    and cover mn-view columns in order (group g = columns g * n ... g * n + n - 1); else None."""
    if not groups:
        return None
    kind, t00, cs0 = groups[0]
    n = len(cs0)
    step = groups[1][1] - t00 if len(groups) > 1 else 0
    for g, (k, t0, cs) in enumerate(groups):
        if k != kind or t0 != t00 + g * step or tuple(cs) != tuple(range(g * n, g * n + n)):
            return None
    return step if n * len(groups) <= 32 else None


@dataclass(frozen=True)
class Dropout:
    """A kernel's dropout: its Philox parameters (``rng``, runtime) and how it makes the keep bits of its tiles
    (compile-time choices of the kernel and the config).  Build it with ``Dropout.create(cfg, ...)``."""

    rng: DropoutRng
    tile_n: int
    quad_ok: bool = True  # every thread's first accumulator column is even and < 8 mod 16 (see philox.py)
    row_loop: bool = True  # ``bits``: one row per iteration of a loop that is not unrolled (else unrolled)
    group_loop: bool = False  # ``bits``: one column group (Philox call) per iteration of a loop not unrolled
    packed: bool = False  # forward with packed GQA rows: keep bits row by row (``bits``)
    high_p: bool = False  # forward, threshold > dropout.F16_DIRECT_MAX_THRESHOLD: the direct test's complement
    # ``bits``: the keep test as sign bits moved in by funnel shifts (the forward, ``as_drop``); else ISETP + SEL +
    # OR per element (the backward: the sign test's unrolled word chains spill its dS code)
    sign_test: bool = False

    @staticmethod
    def create(cfg, tile_n: int, rng: DropoutRng, quad_ok: bool = True, row_loop: bool = True,
               group_loop: bool = False) -> "Dropout":
        return Dropout(rng, tile_n, quad_ok, row_loop, group_loop, getattr(cfg, "dropout_packed", False),
                       getattr(cfg, "dropout_high_p", False))

    @property
    def scale(self):
        """1 / (1 - p), applied once to what accumulated P * keep (O in the forward, dV in the backward)."""
        return self.rng.scale

    # The keep mask of a tile is produced as packed bits (``bits``: one bit per accumulator element of
    # this thread, 32 per Uint32 word) by the kernels *before* their S = Q K^T mma, when neither S nor dP is
    # live, so the Philox work never adds to the peak register pressure of the score / softmax / dS code (in the
    # PTX: ptxas may still move it, e.g. the d128 TMA forward's SASS interleaves it with the softmax, unspilled); the
    # backward consumers read one bit per element, the forward (``apply_fwd``, drop bits) two per PRMT + LOP3.
    def _dropout_groups(self, t0ScS_mn):
        """Trace time: this thread's accumulator columns grouped by Philox call (kernels/philox.py)."""
        ncols = cute.size(t0ScS_mn, mode=[1])
        return column_groups([t0ScS_mn[0, c][1] for c in range(ncols)], self.quad_ok)

    def _group_fn(self, n_block: Int32, col_thr: Int32):
        """Trace time: ``t0 -> (words of the Philox call of column n_block * tile_n + col_thr + t0)`` as a function
        of (qpos, bh, k0, k1).  For t0 and tile_n multiples of 16 the column group is n_block * tile_n / 4 plus
        (g_thr + t0 / 4), the group of an in-tile column (< tile_n / 4); when tile_n / 4 is a power of two that sum
        is an XOR of disjoint bits, which Philox's first XOR absorbs: the per-call group costs one LOP3 with the
        loop-invariant rest, not a shift-and-add chain from the column.  The forward's (``apply_fwd_direct``);
        the keep-bit paths form the group from the column (folded in the windowed dQ kernel, its loop-invariant
        parts held registers for the whole loop, up to the 255 limit, and the loop grew on sm_120a)."""
        g_tile = Uint32(n_block) * Uint32(self.tile_n // 4)
        g_thr = Uint32(((col_thr >> 4) << 2) + ((col_thr & 7) >> 1))
        split = self.tile_n % 16 == 0
        pow2 = split and (self.tile_n // 4) & (self.tile_n // 4 - 1) == 0

        def words(t0: int, qpos, bh, k0, k1):
            if split and t0 % 16 == 0:
                g_in = g_thr + Uint32(t0 // 4)
                return self.rng.group_words(g_tile ^ g_in if pow2 else g_tile + g_in, qpos, bh, k0, k1)
            return self.rng.words(n_block * self.tile_n + col_thr + t0, qpos, bh, k0, k1)

        return words

    def num_words(self, tScS_mn) -> int:
        return -(-cute.size(tScS_mn) // 32)

    @cute.jit
    def _group_values(self, w, kind: cutlass.Constexpr, col: Int32):
        """The 32-bit words of a thread's columns in one Philox call: (w0, w1, w2, w3) for a quad; for a pair
        (columns j, j + 1 only) words 0/1 when j % 16 < 8, else 2/3."""
        if const_expr(kind == "quad"):
            return (w[0], w[1], w[2], w[3])
        else:
            hi = (col & 8) != 0
            return (w[2] if hi else w[0], w[3] if hi else w[1])

    @staticmethod
    def _place(bits: cute.Tensor, first: int, n: int, row: Uint32):
        """Trace time: OR ``n`` keep bits (bit c for element ``first + c``; nothing above bit n - 1) into the
        packed words."""
        if first % 32 + n <= 32:
            shifted = row if first % 32 == 0 else row << Uint32(first % 32)
            bits[first // 32] = bits[first // 32] | shifted
        else:
            for c in range(n):
                idx = first + c
                bits[idx // 32] = bits[idx // 32] | (((row >> Uint32(c)) & Uint32(1)) << Uint32(idx % 32))

    @staticmethod
    def _shift_in(acc: Uint32, x: Uint32) -> Uint32:
        """Trace time: ``acc`` moved up one bit with the sign bit of ``x`` as its new bit 0 (one funnel shift)."""
        return (acc << Uint32(1)) | (x >> Uint32(31))

    @staticmethod
    def _sign_word(xs) -> Uint32:
        """Trace time: a word whose bit i is the sign bit of ``xs[i]`` (at most 32 values): one funnel-shift chain
        per byte (8 dependent shifts, the chains independent of each other), the bytes then merged."""
        word = None
        for b0 in range(0, len(xs), 8):
            chunk = Uint32(0)
            for i in range(min(b0 + 8, len(xs)) - 1, b0 - 1, -1):
                chunk = Dropout._shift_in(chunk, xs[i])
            word = chunk if word is None else word | (chunk << Uint32(b0))
        return word

    @staticmethod
    def _keep_of(drop: Uint32, n: int) -> Uint32:
        """Trace time: keep bits of the ``n`` drop bits at the bottom of ``drop`` (one LOP3)."""
        return ~drop if n == 32 else ~drop & Uint32((1 << n) - 1)

    @cute.jit
    def _paired_bits(self, bits: cute.Tensor, pairs, groups, ncols: int, col_base: Int32, row_qpos: cute.Tensor,
                     row_bh, scalar_bh: cutlass.Constexpr, k0: Uint32, k1: Uint32, t: Uint32):
        """Keep bits of the thread's row pairs (mn rows r, r + 1 = tile rows g, g + 8 of an m16 atom), which are
        query positions i, i + 8 (i % 16 < 8) of one head: one Philox call per column group gives both rows (low
        halves row i, high halves row i + 8).  Several pairs are a loop that is not unrolled (as in
        ``_single_row_bits``) when the bits fit a 64-bit shift register and the kernel's ``dropout_row_loop``
        says so."""
        npairs = len(pairs)
        total = 2 * npairs * ncols
        if const_expr(npairs > 1 and total <= 64 and ncols <= 32 and self.row_loop):
            lo = Uint32(0)
            hi = Uint32(0)
            for pi in cutlass.range(npairs, unroll=1):
                qpos = row_qpos[pairs[0][0]]
                for pj in cutlass.range_constexpr(1, npairs):
                    qpos = row_qpos[pairs[pj][0]] if pi == pj else qpos
                bh = Int32(0)
                if const_expr(scalar_bh):
                    bh = row_bh
                else:
                    bh = row_bh[pairs[0][0]]
                    for pj in cutlass.range_constexpr(1, npairs):
                        bh = row_bh[pairs[pj][0]] if pi == pj else bh
                # shift register: pairs are rows (2k, 2k + 1); after the last pair, row r sits at [r * ncols, ...)
                if const_expr(self.sign_test):
                    both = self._pair_keep(groups, ncols, col_base, qpos, bh, k0, k1, t)
                else:
                    lo_row, hi_row = self._pair_rows(groups, col_base, qpos, bh, k0, k1, t)
                    both = lo_row | (hi_row << Uint32(ncols))
                lo, hi = _shift_pair(lo, hi, 2 * ncols, both, total - 2 * ncols)
            bits[0] = lo
            if const_expr(total > 32):
                bits[1] = hi
        else:
            for pi in cutlass.range_constexpr(npairs):
                ra, rb = pairs[pi]
                bh = row_bh if const_expr(scalar_bh) else row_bh[ra]
                if const_expr(rb == ra + 1 and 2 * ncols <= 32 and self.sign_test):
                    both = self._pair_keep(groups, ncols, col_base, row_qpos[ra], bh, k0, k1, t)
                    self._place(bits, ra * ncols, 2 * ncols, both)
                else:
                    lo_row, hi_row = self._pair_rows(groups, col_base, row_qpos[ra], bh, k0, k1, t)
                    self._place(bits, ra * ncols, ncols, lo_row)
                    self._place(bits, rb * ncols, ncols, hi_row)

    # The keep test of a value x (KEEP_BITS wide) against the threshold t (<= 2**KEEP_BITS): x - t as a 32-bit
    # integer is negative exactly when x is dropped, so its sign bit is the drop bit (``_lo``/``_hi`` then one
    # IADD3 or LEA.HI), moved into a drop word by one funnel shift per element (``_sign_word``); the
    # keep bits are the complement, one LOP3 per word (none where the caller asks for drop bits).
    @cute.jit
    def _pair_keep(self, groups, ncols: cutlass.Constexpr[int], col_base: Int32, qpos: Int32, bh: Int32,
                   k0: Uint32, k1: Uint32, t: Uint32) -> Uint32:
        """Keep bits of query rows qpos (i % 16 < 8) at bits [0, ncols) and qpos + 8 at [ncols, 2 ncols) (bit c
        of each for mn-view column c; 2 ncols <= 32): the Philox calls unrolled, as in ``_pair_rows``, and one
        word for both rows."""
        col_word = [None] * ncols
        for gi in cutlass.range_constexpr(len(groups)):
            kind, t0, cs = groups[gi]
            w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
            mine = self._group_values(w, kind, col_base + t0)
            for e in cutlass.range_constexpr(len(cs)):
                col_word[cs[e]] = mine[e]
        drop = self._sign_word([_lo(v) - t for v in col_word] + [_hi(v) - _t_hi(t) for v in col_word])
        return self._keep_of(drop, 2 * ncols)

    @cute.jit
    def _pair_rows(self, groups, col_base: Int32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32, t: Uint32):
        """Keep bits (bit c for mn-view column c) of query rows qpos (i % 16 < 8) and qpos + 8.  With
        ``group_loop`` (a kernel choice, where the unrolled calls spill) and evenly spaced groups, the column
        groups are a loop that is not unrolled: one Philox call in flight, bits shifted in per group."""
        lo_row = Uint32(0)
        hi_row = Uint32(0)
        ncols = sum(len(cs) for _, _, cs in groups)
        step = _regular_step(groups)
        if const_expr(self.group_loop and step is not None and len(groups) > 1):
            kind = groups[0][0]
            per = len(groups[0][2])
            for gi in cutlass.range(len(groups), unroll=1):
                col = col_base + gi * step
                w = self.rng.words(col, qpos, bh, k0, k1)
                mine = self._group_values(w, kind, col)
                lo_g = Uint32(0)
                hi_g = Uint32(0)
                if const_expr(self.sign_test):
                    for e in cutlass.range_constexpr(per - 1, -1, -1):
                        lo_g = self._shift_in(lo_g, _lo(mine[e]) - t)
                        hi_g = self._shift_in(hi_g, _hi(mine[e]) - _t_hi(t))
                else:  # drop bits, as the sign test's
                    for e in cutlass.range_constexpr(per):
                        lo_g = lo_g | (Uint32(1 << e) if _lo(mine[e]) < t else Uint32(0))
                        hi_g = hi_g | (Uint32(1 << e) if _hi(mine[e]) < _t_hi(t) else Uint32(0))
                # shift register of drop bits: after the last group, group g's bits sit at [g * per, (g + 1) * per)
                lo_row = (lo_row >> Uint32(per)) | (lo_g << Uint32(ncols - per))
                hi_row = (hi_row >> Uint32(per)) | (hi_g << Uint32(ncols - per))
        else:
            col_word = [None] * ncols
            for gi in cutlass.range_constexpr(len(groups)):
                kind, t0, cs = groups[gi]
                w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
                mine = self._group_values(w, kind, col_base + t0)
                for e in cutlass.range_constexpr(len(cs)):
                    if const_expr(self.sign_test):
                        col_word[cs[e]] = mine[e]
                    else:
                        lo_row = lo_row | (Uint32(1 << cs[e]) if _lo(mine[e]) >= t else Uint32(0))
                        hi_row = hi_row | (Uint32(1 << cs[e]) if _hi(mine[e]) >= _t_hi(t) else Uint32(0))
            if const_expr(self.sign_test):
                lo_row = self._keep_of(self._sign_word([_lo(v) - t for v in col_word]), ncols)
                hi_row = self._keep_of(self._sign_word([_hi(v) - _t_hi(t) for v in col_word]), ncols)
        if const_expr(self.group_loop and step is not None and len(groups) > 1):
            lo_row = self._keep_of(lo_row, ncols)
            hi_row = self._keep_of(hi_row, ncols)
        return lo_row, hi_row

    @cute.jit
    def _row_bits(self, groups, col_base: Int32, qpos: Int32, bh: Int32, k0: Uint32, k1: Uint32,
                  t: Uint32) -> Uint32:
        """Keep bits of one row on its own (bit c for mn-view column c, ncols <= 32): the row's half of each
        Philox call, the other half unused (rows that do not pair up: packed GQA in the forward)."""
        ncols = sum(len(cs) for _, _, cs in groups)
        col_word = [None] * ncols
        row = Uint32(0)
        shift = Uint32((qpos & 8) << 1)  # 0 for i % 16 < 8 (low half), 16 otherwise
        for gi in cutlass.range_constexpr(len(groups)):
            kind, t0, cs = groups[gi]
            w = self.rng.words(col_base + t0, qpos, bh, k0, k1)
            mine = self._group_values(w, kind, col_base + t0)
            for e in cutlass.range_constexpr(len(cs)):
                if const_expr(self.sign_test):
                    col_word[cs[e]] = mine[e]
                else:
                    row = row | (Uint32(1 << cs[e]) if ((mine[e] >> shift) & Uint32(VALUE_MASK)) >= t else Uint32(0))
        if const_expr(self.sign_test):
            row = self._keep_of(self._sign_word([((v >> shift) & Uint32(VALUE_MASK)) - t for v in col_word]), ncols)
        return row

    @cute.jit
    def _single_row_bits(self, bits: cute.Tensor, groups, nrows: int, ncols: int, col_base: Int32,
                         row_qpos: cute.Tensor, row_bh, scalar_bh: cutlass.Constexpr, k0: Uint32, k1: Uint32,
                         t: Uint32):
        """Keep bits row by row (one Philox call per row and column group).  The rows are a loop that is not
        unrolled when the bits fit one 64-bit shift register and the kernel's ``dropout_row_loop`` says so: ptxas
        then cannot interleave the Philox calls of every row for ILP, which would need ~10 registers per call in
        flight."""
        total = nrows * ncols
        if const_expr(total <= 64 and ncols <= 32 and self.row_loop):
            lo = Uint32(0)
            hi = Uint32(0)
            for r in cutlass.range(nrows, unroll=1):
                qpos = row_qpos[0]
                for rr in cutlass.range_constexpr(1, nrows):
                    qpos = row_qpos[rr] if r == rr else qpos
                bh = Int32(0)
                if const_expr(scalar_bh):
                    bh = row_bh
                else:
                    bh = row_bh[0]
                    for rr in cutlass.range_constexpr(1, nrows):
                        bh = row_bh[rr] if r == rr else bh
                row = self._row_bits(groups, col_base, qpos, bh, k0, k1, t)
                # shift register: after the last row, row r sits at bits [r * ncols, (r + 1) * ncols)
                lo, hi = _shift_pair(lo, hi, ncols, row, total - ncols)
            bits[0] = lo
            if const_expr(total > 32):
                bits[1] = hi
        else:
            for r in cutlass.range_constexpr(nrows):
                bh = row_bh if const_expr(scalar_bh) else row_bh[r]
                self._place(bits, r * ncols, ncols, self._row_bits(groups, col_base, row_qpos[r], bh, k0, k1, t))

    @cute.jit
    def bits(self, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor, row_bh,
                     n_block: Int32, as_drop: cutlass.Constexpr[bool] = False) -> cute.Tensor:
        """Keep bits of this thread's elements of an S tile: bit ``e % 32`` of word ``e // 32`` for element
        ``e = r * ncols + c`` of the mn view.  ``row_bh``: (batch << 16) | query head, one per row (an rmem tensor,
        forward with packed GQA) or one for all rows (an Int32, backward).  ``as_drop``: the complement (drop
        bits; the bits past the last element of the last word are then undefined), which the test forms first.

        A thread's rows g and g + 8 of each m16 atom are query positions i, i + 8 (i % 16 < 8) of one head in the
        backward kernels and in the forward without GQA packing: one Philox call then decides 8 elements, all
        this thread's.  A forward compiled for packed GQA rows (``packed``: a row is a (position, head)
        pair; the dispatcher picks that config whenever pack > 1) makes each row on its own, using half of each
        call."""
        nrows = cute.size(tScS_mn, mode=[0])
        ncols = cute.size(tScS_mn, mode=[1])
        groups = self._dropout_groups(t0ScS_mn)
        pairs = row_pairs([t0ScS_mn[r, 0][0] for r in range(nrows)])
        bits = cute.make_rmem_tensor(self.num_words(tScS_mn), Uint32)
        bits.fill(0)
        k0, k1 = self.rng.key()
        t = Uint32(self.rng.threshold)
        col_base = n_block * self.tile_n + tScS_mn[0, 0][1]
        scalar_bh = isinstance(row_bh, (int, cutlass.Numeric))
        hook = replace(self, sign_test=as_drop)
        if const_expr(pairs is None or self.packed):
            hook._single_row_bits(bits, groups, nrows, ncols, col_base, row_qpos, row_bh, scalar_bh, k0, k1, t)
        else:
            hook._paired_bits(bits, pairs, groups, ncols, col_base, row_qpos, row_bh, scalar_bh, k0, k1, t)
        if const_expr(as_drop):
            for i in cutlass.range_constexpr(cute.size(bits)):
                bits[i] = ~bits[i]
        return bits

    @cute.jit
    def bits_keyrows(self, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor, row_qpos: cute.Tensor, bh: Int32,
                             n_block: Int32) -> cute.Tensor:
        """Keep bits (element ``e = r * ncols + c`` of the [query, key] view, as ``bits``) of an S^T tile of
        the key-row dK/dV kernel (bwd_dkdv_kvrows.py), where a thread holds two keys of one Philox column group,
        j0 + p and j0 + 8 + p (p = 0 or 1), and query pairs (i, i + 8) with i % 16 < 8: of one call it needs only
        words p and 2 + p.  The lanes holding keys j0 + p and j0 + 1 - p (lane ^ 4) hold the same queries, so of the
        two row pairs (i, i + 8) with i = 16 b + 2 t and 16 b + 2 t + 1, each lane makes the call of the one whose
        parity is its key's, and hands the two words the other lane needs over by two shuffles: one Philox call per
        8 elements, as in the other kernels."""
        nrows = cute.size(tScS_mn, mode=[0])
        ncols = cute.size(tScS_mn, mode=[1])
        rows = [int(t0ScS_mn[r, 0][0]) for r in range(nrows)]
        cols = [int(t0ScS_mn[0, c][1]) for c in range(ncols)]
        if const_expr(cols != [0, 8] or nrows % 4 or rows != [8 * (r // 2) + r % 2 for r in range(nrows)]):
            raise ValueError(f"bits_keyrows: thread layout of the key-row tile not as expected: query "
                             f"offsets {rows}, key offsets {cols}")
        if const_expr(nrows * ncols > 32):
            raise ValueError(f"bits_keyrows: {nrows * ncols} elements per thread, at most 32")
        k0, k1 = self.rng.key()
        t = Uint32(self.rng.threshold)
        key = n_block * self.tile_n + tScS_mn[0, 0][1]
        odd = (key & 1) != 0
        j0 = key - (key & 1)
        bits = cute.make_rmem_tensor(1, Uint32)
        bits.fill(0)
        for b in cutlass.range_constexpr(nrows // 4):
            # this lane's call: query row pair (4b + p, 4b + 2 + p) of the view, p its key's parity
            qpos = row_qpos[4 * b + 1] if odd else row_qpos[4 * b]
            w = self.rng.words(j0, qpos, bh, k0, k1)
            send0 = w[0] if odd else w[1]
            send1 = w[2] if odd else w[3]
            mine0 = w[1] if odd else w[0]
            mine1 = w[3] if odd else w[2]
            got0 = Uint32(cute.arch.shuffle_sync_bfly(Int32(send0), offset=4))
            got1 = Uint32(cute.arch.shuffle_sync_bfly(Int32(send1), offset=4))
            for e in cutlass.range_constexpr(2):
                # words of keys (j0 + p, j0 + 8 + p) for the row pair of parity e: this lane's call when e == p
                wa = (got0 if odd else mine0) if e == 0 else (mine0 if odd else got0)
                wb = (got1 if odd else mine1) if e == 0 else (mine1 if odd else got1)
                for r, shift in ((4 * b + e, 0), (4 * b + 2 + e, 16)):
                    for c, wv in ((0, wa), (1, wb)):
                        idx = r * ncols + c
                        x, tx = (_hi(wv), _t_hi(t)) if shift else (_lo(wv), t)
                        bits[0] = bits[0] | (Uint32(1 << idx) if x >= tx else Uint32(0))
        return bits

    @staticmethod
    def kept(bits: cute.Tensor, idx: int):
        """Element ``idx``'s keep bit (``idx`` is trace-time)."""
        return (bits[idx // 32] & Uint32(1 << (idx % 32))) != Uint32(0)

    @cute.jit
    def apply_fwd(self, acc_P: cute.Tensor, drop: cute.Tensor):
        """Zero the dropped probabilities of a P tile (16-bit, after the online softmax summed them); ``drop``: the
        tile's drop bits (``bits(..., as_drop=True)``).  Columns (c, c + 1) of a row are one 32-bit register
        of the compact 16-bit tile: one LOP3 clears it with a mask whose halves are the two drop bits replicated
        (one PRMT in sign-replicate mode, from copies of the bit word shifted so that each bit sits at the top of
        a byte: one shift per copy, 7 per word)."""
        p_mn = acc_mn_view(acc_P)
        nrows = cute.size(p_mn, mode=[0])
        ncols = cute.size(p_mn, mode=[1])
        if const_expr(ncols % 2 == 0 and acc_P.element_type.width == 16 and self._pairs_adjacent(p_mn)):
            p32 = cute.make_tensor(cute.recast_ptr(acc_P.iterator, dtype=Uint32),
                                   cute.make_layout(cute.size(acc_P) // 2))
            copies = {}
            for r in cutlass.range_constexpr(nrows):
                for c in cutlass.range_constexpr(0, ncols, 2):
                    e = r * ncols + c
                    word, pos = e // 32, e % 32  # e even: bits pos, pos + 1 lie in byte pos // 8
                    lo = self._bits_copy(copies, drop, word, 7 - pos % 8)
                    hi = self._bits_copy(copies, drop, word, 6 - pos % 8)
                    b = pos // 8
                    # result bytes 0-1: top bit of byte b of lo replicated; bytes 2-3: of byte b of hi (4 + b)
                    sel = (8 | b) | ((8 | b) << 4) | ((12 | b) << 8) | ((12 | b) << 12)
                    mask = Uint32(cute.arch.prmt(lo, hi, Int32(sel)))
                    i = cute.crd2idx((r, c), p_mn.layout) // 2
                    p32[i] = p32[i] & ~mask
        else:
            for r in cutlass.range_constexpr(nrows):
                for c in cutlass.range_constexpr(ncols):
                    dropped = self.kept(drop, r * ncols + c)
                    p_mn[r, c] = p_mn.element_type(0.0) if dropped else p_mn[r, c]

    def fwd_direct_ok(self, acc_P: cute.Tensor, t0ScS_mn: cute.Tensor) -> bool:
        """Trace time: whether ``apply_fwd_direct`` serves this forward tile: rows in pairs of one head (not
        packed GQA), column groups unrolled (not ``group_loop``), a 16-bit P whose columns (c, c + 1) share a
        register, and every group's columns in such pairs."""
        p_mn = acc_mn_view(acc_P)
        nrows = cute.size(p_mn, mode=[0])
        if self.packed or self.group_loop or acc_P.element_type.width != 16:
            return False
        if row_pairs([t0ScS_mn[r, 0][0] for r in range(nrows)]) is None or not self._pairs_adjacent(p_mn):
            return False
        return all(cs[e] % 2 == 0 and cs[e + 1] == cs[e] + 1
                   for _, _, cs in self._dropout_groups(t0ScS_mn) for e in range(0, len(cs), 2))

    @cute.jit
    def apply_fwd_direct(self, acc_P: cute.Tensor, tScS_mn: cute.Tensor, t0ScS_mn: cute.Tensor,
                           row_qpos: cute.Tensor, row_bh, n_block: Int32):
        """Zero the dropped probabilities of a 16-bit P tile straight from the Philox words, after the online
        softmax (no bit words; ``fwd_direct_ok`` says where it applies).  A P register holds columns (c, c + 1)
        of one row, whose values are the same half (low for row i0, high for i0 + 8) of the words of c and c + 1:
        one PRMT gathers them, one HSET2 compares both as fp16 numbers with the sign bit dropped by the operand's
        absolute value (the 15-bit values 0 ... 0x7BFF are finite and ordered as the integers; dropout.py) against
        the threshold in both halves, giving the drop mask (0xFFFF per dropped half), and one LOP3 clears them:
        3 instructions per 2 elements (4 with the 13-bit values, whose top bits a LOP3 had to clear; about 7 with
        bit words).  Thresholds above 0x7C00 (+inf; ``high_p``, p > 0.96875) test the complement instead:
        keep iff 0x7FFF - value < 2**15 - threshold, one LOP3 more.  Column groups as ``_group_fn``."""
        p_mn = acc_mn_view(acc_P)
        nrows = cute.size(p_mn, mode=[0])
        groups = self._dropout_groups(t0ScS_mn)
        pairs = row_pairs([t0ScS_mn[r, 0][0] for r in range(nrows)])
        p32 = cute.make_tensor(cute.recast_ptr(acc_P.iterator, dtype=Uint32), cute.make_layout(cute.size(acc_P) // 2))
        k0, k1 = self.rng.key()
        t = Uint32(self.rng.threshold)
        if const_expr(self.high_p):
            t = Uint32(1 << KEEP_BITS) - t  # < 0x400 here: a finite fp16 pattern
        tt = t | (t << Uint32(16))  # both halves hold it
        col_thr = tScS_mn[0, 0][1]
        call = self._group_fn(n_block, col_thr)
        scalar_bh = isinstance(row_bh, (int, cutlass.Numeric))
        for pi in cutlass.range_constexpr(len(pairs)):
            ra, rb = pairs[pi]
            bh = row_bh if const_expr(scalar_bh) else row_bh[ra]
            for gi in cutlass.range_constexpr(len(groups)):
                kind, t0, cs = groups[gi]
                w = call(t0, row_qpos[ra], bh, k0, k1)
                mine = self._group_values(w, kind, n_block * self.tile_n + col_thr + t0)
                for e in cutlass.range_constexpr(0, len(cs), 2):
                    # low halves (bytes 0-1 of each word) for row ra, high halves (bytes 2-3) for row rb
                    for r, sel in ((ra, 0x5410), (rb, 0x7632)):
                        z = Uint32(cute.arch.prmt(mine[e], mine[e + 1], Int32(sel)))
                        i = cute.crd2idx((r, cs[e]), p_mn.layout) // 2
                        if const_expr(self.high_p):
                            p32[i] = p32[i] & lt_abs_mask_f16x2(~z, tt)  # keep mask
                        else:
                            p32[i] = p32[i] & ~lt_abs_mask_f16x2(z, tt)  # drop mask

    @staticmethod
    def _pairs_adjacent(p_mn) -> bool:
        """Trace time: every even mn-view column c of a row is an even register index and c + 1 the next one."""
        for r in range(cute.size(p_mn, mode=[0])):
            for c in range(0, cute.size(p_mn, mode=[1]), 2):
                i = cute.crd2idx((r, c), p_mn.layout)
                if i % 2 or cute.crd2idx((r, c + 1), p_mn.layout) != i + 1:
                    return False
        return True

    @staticmethod
    def _bits_copy(copies: dict, bits: cute.Tensor, word: int, k: int) -> Uint32:
        """Trace time: bit word ``word`` shifted left by ``k``, formed once per (word, k)."""
        if (word, k) not in copies:
            copies[(word, k)] = bits[word] if k == 0 else bits[word] << Uint32(k)
        return copies[(word, k)]
