"""Host-only configuration layer: tile table, resource budgets, and the frozen compile key of the forward kernel
(split-KV included).  The decode tiles are in ``config_decode``, the backward kernels' configuration in
``config_bwd`` and the split-KV combine kernel's in ``config_combine`` (all import from this module, never the
other way).

Nothing here imports CuTe-DSL, so it is cheap to import and fully testable on a CPU.

Limits are those of SM120/SM121 (RTX 5090, RTX PRO 6000, DGX Spark), kept on every kernel even when it runs on the
H100 proxy: at most 101376 B of shared memory per CTA, mma.sync m16n8k16 only, no clusters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace  # noqa: F401 (config.replace: tests and benchmarks use it)

# ---- hardware budget (SM120 / SM121) -------------------------------------------------------------------------
SMEM_LIMIT_BYTES = 101376  # max dynamic shared memory per block on SM12x (99 KB)
MAX_REGS_PER_THREAD = 255
# Registers a thread needs beyond the accumulators and operand fragments (addresses, softmax state, loop
# counters, predicates): the margin at which the sm_120a compile gate's configurations compile without spills
# (scripts/compile_gate.py; benchmarks/results/gate_hand_sm120a_device_s30.jsonl).
REG_OVERHEAD = 48
# Largest register estimate (fwd_register_estimate) accepted for a tile: kept below the estimate at which the
# sm_120a compile gate first saw a spill (d=192/dv=192, Q in registers, heaviest feature set), so a tile the
# estimate accepts compiles without one.
REG_ESTIMATE_BUDGET = 232

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = ("bf16", "fp16")
# Sequence lengths, batch and heads are limited so that every index the kernel forms fits in int32 without
# overflow, and so that the grid fits CUDA's limits (gridDim.y/z <= 65535).
MAX_SEQLEN = (1 << 28) - 1
MAX_GRID_YZ = 65535
# Stand-in for an unbounded sliding-window side (kernel arithmetic stays in int32 range with MAX_SEQLEN).
WINDOW_UNBOUNDED = 1 << 29


def copy_threads_per_row(k_dim: int, elem_bits: int) -> int:
    """Threads that share one row in the 16-byte-vector gmem<->smem copies: largest power of two dividing the
    number of vectors per row, at most 16."""
    vectors = k_dim * elem_bits // 128
    tpr = 1
    while tpr < 16 and vectors % (tpr * 2) == 0:
        tpr *= 2
    return tpr


@dataclass(frozen=True)
class FwdTile:
    """Structural choice of the forward kernel: CTA tile, warps (stacked along M), K/V pipeline depth, and
    whether Q fragments stay in registers for the whole CTA."""

    tile_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    q_in_regs: bool = False
    tma: bool = False  # warp-specialised: a TMA producer warp feeds the mma warps (kernels/fwd_tma.py)
    # key split (decode tiles, kernels/fwd_decode.py): the warps form ``kv_groups`` groups of num_warps / kv_groups
    # warps stacked along M; group g takes keys [g, g + 1) * tile_n / kv_groups of every K/V tile for all tile_m
    # rows, and the groups' softmax states are merged once, in the epilogue.  1 = every warp sees every key.
    kv_groups: int = 1

    @property
    def num_threads(self) -> int:
        """Threads that own accumulators (the CTA has one more warp when ``tma``)."""
        return self.num_warps * 32

    @property
    def mma_warps(self) -> int:
        """Warps that share one group's keys, stacked along M (all of them without a key split)."""
        return self.num_warps // self.kv_groups

    def name(self) -> str:
        return (f"{self.tile_m}x{self.tile_n}w{self.num_warps}s{self.num_stages}{'q' if self.q_in_regs else ''}"
                f"{'t' if self.tma else ''}{f'k{self.kv_groups}' if self.kv_groups > 1 else ''}")


@dataclass(frozen=True)
class FwdKernelConfig:
    """The compile key of one forward kernel.  Batch, sequence lengths, head counts, GQA ratio, window sizes,
    softmax scale and softcap value are runtime arguments: they never trigger a recompile."""

    dtype: str  # "bf16" | "fp16"
    head_dim: int
    head_dim_v: int
    tile: FwdTile
    windowed: bool = False  # causal or sliding window (runtime left/right bounds)
    has_softcap: bool = False
    has_sink: bool = False
    varlen_q: bool = False  # q/o are (total_q, H, D) with cu_seqlens_q
    varlen_k: bool = False  # k/v are (total_k, H, D) with cu_seqlens_k
    seqused_q: bool = False
    seqused_k: bool = False
    # k/v are (num_pages, page_size, Hkv, D) addressed through a page table: the cp.async kernel (rows gathered one
    # by one), or on a TMA tile (``paged_tma_tile``: page_size % tile_n == 0, one TMA box per K/V tile)
    paged: bool = False
    has_dropout: bool = False  # Philox dropout (p is a runtime value; p = 0 uses the config without it)
    dropout_seed_tensor: bool = False  # the seed is read from a device int64 tensor (CUDA-graph replays)
    # dropout with packed GQA rows (pack > 1): a thread's rows g, g + 8 are not query positions i, i + 8 of one
    # head, so the keep bits are made row by row (half of each Philox call); otherwise one call serves both rows
    dropout_packed: bool = False
    # p > 0.96875 (threshold above dropout.F16_DIRECT_MAX_THRESHOLD): the forward's direct keep test compares the
    # values' complement (kernels/score_dropout.py Dropout.apply_fwd_direct); the keep-bit paths need no variant
    dropout_high_p: bool = False
    split_kv: bool = False  # out/lse are fp32 partials (splits, ...) of a split-KV call (grid z folds the split)
    # block sparsity (kernels/block_sparse.py; the tile from select_sparse_tile): a user block is sparse_q_ratio
    # query tiles by sparse_kv_ratio KV tiles; 0 = off
    sparse_q_ratio: int = 0
    sparse_kv_ratio: int = 0
    # score_mod / mask_mod of the call (modspec.ModSpec: keyed by the mods' identity and source and the aux
    # tensors' dtype/rank), None when off
    mods: object = None

    @property
    def block_sparse(self) -> bool:
        return self.sparse_q_ratio > 0

    @property
    def has_aux(self) -> bool:
        return self.mods is not None and bool(self.mods.aux_sig)

    def name(self) -> str:
        flags = [
            n
            for n, on in (
                ("win", self.windowed),
                ("softcap", self.has_softcap),
                ("sink", self.has_sink),
                ("vq", self.varlen_q),
                ("vk", self.varlen_k),
                ("uq", self.seqused_q),
                ("uk", self.seqused_k),
                ("paged", self.paged),
                ("drop", self.has_dropout),
                ("seedt", self.dropout_seed_tensor),
                ("dpack", self.dropout_packed),
                ("dhi", self.dropout_high_p),
                ("split", self.split_kv),
                (f"sparse{self.sparse_q_ratio}x{self.sparse_kv_ratio}", self.block_sparse),
                (f"mods{self.mods.tag() if self.mods is not None else ''}", self.mods is not None),
            )
            if on
        ]
        return f"fwd_{self.dtype}_d{self.head_dim}v{self.head_dim_v}_{self.tile.name()}" + (
            "_" + "_".join(flags) if flags else ""
        )


def fwd_smem_bytes(head_dim: int, head_dim_v: int, tile: FwdTile, elem_bytes: int = 2) -> int:
    """Shared memory of the forward kernel: Q tile + K and V stages, each region 1024-byte aligned.
    The O staging buffer of the epilogue aliases this space (it needs tile_m*head_dim_v elements)."""

    def align(n: int) -> int:
        return (n + 1023) // 1024 * 1024

    q = align(tile.tile_m * head_dim * elem_bytes)
    k = align(tile.num_stages * tile.tile_n * head_dim * elem_bytes)
    v = align(tile.num_stages * tile.tile_n * head_dim_v * elem_bytes)
    mbarriers = align(2 * 2 * tile.num_stages * 8) if tile.tma else 0  # full+empty for K and V
    return mbarriers + q + k + v


def key_split_merge_bytes(head_dim_v: int, tile: FwdTile) -> int:
    """Shared memory the key-split merge takes (aliasing the K/V stages): each group but the first parks its
    threads' O accumulators and row max / row sum (2 rows per thread) in fp32."""
    group_threads = tile.mma_warps * 32
    per_thread = tile.tile_m * head_dim_v // group_threads + 4
    return (tile.kv_groups - 1) * group_threads * per_thread * 4


def fwd_register_estimate(head_dim: int, head_dim_v: int, tile: FwdTile) -> int:
    threads = tile.num_threads
    acc_o = tile.tile_m * head_dim_v // (threads // tile.kv_groups)
    acc_s = tile.tile_m * tile.tile_n // threads
    q_regs = tile.tile_m * head_dim // (2 * threads) if tile.q_in_regs else 0
    # P in 16-bit (half of acc_s) lives while acc_s is reused; fragments of K/V for one k-step are small.
    return acc_o + acc_s + acc_s // 2 + q_regs + REG_OVERHEAD


def fwd_register_budget(tile: FwdTile) -> int:
    """Registers an mma thread may use, by fwd_register_estimate (the TMA kernel's mma warps get 240 through
    setmaxnreg; at d=dv=192 with Q in registers, estimate 240, they spilled).  The compile gate is the binding
    check."""
    return 232 if tile.tma else REG_ESTIMATE_BUDGET


def fwd_tile_problems(head_dim: int, head_dim_v: int, tile: FwdTile) -> list[str]:
    """Reasons a tile cannot run this head-dim pair within SM120's budget (empty list: it can)."""
    problems = []
    if tile.num_warps not in (4, 8):
        problems.append(f"num_warps={tile.num_warps} (supported: 4, 8)")
    if tile.kv_groups not in (1, 2, 4) or tile.num_warps % tile.kv_groups:
        problems.append(f"kv_groups={tile.kv_groups} (supported: 1, 2, 4, dividing num_warps={tile.num_warps})")
        return problems
    if tile.kv_groups > 1 and (tile.tma or tile.q_in_regs):
        problems.append("a key split (kv_groups > 1) runs on the cp.async kernel with Q read from shared memory")
    if tile.tile_m % (16 * tile.mma_warps) != 0:
        problems.append(f"tile_m={tile.tile_m} is not a multiple of 16 * the warps along M ({16 * tile.mma_warps})")
    if tile.tile_n % (16 * tile.kv_groups) != 0 or tile.tile_n < 16:
        problems.append(f"tile_n={tile.tile_n} is not a positive multiple of 16 * kv_groups={16 * tile.kv_groups}")
    if tile.num_stages not in ((1, 2) if tile.tma else (1, 2, 3, 4, 5)):
        problems.append(f"num_stages={tile.num_stages} (supported: 1 or 2 on the TMA kernel, 1 to 5 on cp.async)")
    for dim in (head_dim, head_dim_v):
        rows_per_pass = tile.num_threads // copy_threads_per_row(dim, 16)
        for rows, what in ((tile.tile_m, "tile_m"), (tile.tile_n, "tile_n")):
            if rows % rows_per_pass != 0:
                problems.append(f"{what}={rows} is not a multiple of the copy's {rows_per_pass} rows per pass (d={dim})")
    smem = fwd_smem_bytes(head_dim, head_dim_v, tile)
    if tile.tile_m * head_dim_v * 2 > smem:
        problems.append("the O staging tile does not fit in the kernel's shared memory")
    if smem > SMEM_LIMIT_BYTES:
        problems.append(f"needs {smem} B of shared memory > SM120 limit {SMEM_LIMIT_BYTES} B")
    if tile.kv_groups > 1:
        kv_bytes = tile.num_stages * tile.tile_n * (head_dim + head_dim_v) * 2
        if key_split_merge_bytes(head_dim_v, tile) > kv_bytes:
            problems.append(f"the key-split merge needs {key_split_merge_bytes(head_dim_v, tile)} B > the "
                            f"{kv_bytes} B of K/V stages it reuses")
    regs = fwd_register_estimate(head_dim, head_dim_v, tile)
    if regs > fwd_register_budget(tile):
        problems.append(f"needs ~{regs} registers per thread (budget {fwd_register_budget(tile)})")
    if tile.tma and tile.num_warps != 8:
        problems.append("the TMA kernel runs 8 mma warps + one producer warpgroup")
    return problems


# Causal / windowed forward tiles launch longest first across every (head group, batch), not only inside one,
# on grids of FWD_LPT_MIN_COLUMNS to FWD_LPT_MAX_COLUMNS tile columns (kernels/fwd_base.py ``cta_coords``).
# Longest first shortens the tail of the last wave, which pays on mid-sized grids; on short grids (few waves) and
# long ones (a small tail) the plain order, which keeps a head's tiles and so its K/V in L2 together, is as fast or
# faster (benchmarks/experiments/results/lpt_h100.jsonl, causal, bench_fwd's cells).  ``False`` restores the plain
# order everywhere (an A/B switch for benchmarks/experiments/probe_lpt.py; none of these is part of the compile
# key).
FWD_LPT_ORDER = True
FWD_LPT_MIN_COLUMNS = 32
FWD_LPT_MAX_COLUMNS = 127

# ---- tile table --------------------------------------------------------------------------------------------
# Preference order per head dim (first that fits wins), from the forward tile sweeps with SM120's limits kept
# (benchmarks/experiments/results/tile_sweep_h100_v1.jsonl and _v2.jsonl hold the timings):
#  * 16 or 32 query rows per warp; 4-warp 128-row tiles spill at d=128 on sm_120a (too many accumulator
#    registers per thread).
#  * tma=True: warp-specialised kernel, TMA producer warpgroup + 8 mma warps (kernels/fwd_tma.py); it beat the
#    all-warps cp.async kernel at d=64..128 (the producer overlaps the loads the cp.async warps issue themselves).
#  * d<=64: 256x64 tiles (2 m16 atoms per warp, half the smem reads per flop) beat 128x128.
#  * d=256: the 4-warp 64x64 cp.async tile beat the TMA 128x32 tile, and the TMA kernel's 240-register consumers
#    spill at d=dv=256 under the heaviest feature set.
#  * software pipelining of QK^T measured slower (the extra live fragments) and was removed.
# The cp.async tiles after the TMA ones are the fallback when a TMA tile does not fit.
_TILE_PREFERENCE: dict[int, tuple[FwdTile, ...]] = {
    32: (FwdTile(256, 64, 8, 2, False, True), FwdTile(128, 128, 8, 2, True)),
    64: (FwdTile(256, 64, 8, 2, False, True), FwdTile(128, 128, 8, 2, True)),
    96: (FwdTile(128, 64, 8, 2, True, True), FwdTile(128, 64, 8, 2, True)),
    128: (FwdTile(128, 64, 8, 2, True, True), FwdTile(128, 64, 8, 2, True)),
    192: (FwdTile(128, 64, 8, 1, True, True), FwdTile(128, 64, 8, 1, False, True), FwdTile(128, 64, 8, 1, False)),
    256: (FwdTile(64, 64, 4, 1, False), FwdTile(64, 32, 4, 1, False)),
}
# Causal / sliding-window overrides: 256-row tiles leave too few, too unequal tiles at short lengths
# (benchmarks/experiments/results/tile_sweep_h100_v1.jsonl, d=64 S=1024 causal).
_TILE_PREFERENCE_WINDOWED: dict[int, tuple[FwdTile, ...]] = {
    32: (FwdTile(128, 128, 8, 2, True, True), FwdTile(128, 128, 8, 2, True)),
    64: (FwdTile(128, 128, 8, 2, True, True), FwdTile(128, 128, 8, 2, True)),
}


def candidate_tiles(head_dim: int, head_dim_v: int, windowed: bool = False, paged: bool = False, tma: bool = True
                    ) -> tuple[FwdTile, ...]:
    """Tiles in preference order.  ``paged``: the cp.async tiles only, which gather rows one by one with per-row
    addresses and so serve any page size from 1 up; a page size that is a multiple of the TMA tile's tile_n runs
    the TMA tile instead (``paged_tma_tile``, picked by the dispatcher, which knows the page size).  ``tma``: the
    device has TMA (device.DeviceCaps.tma); without it, the cp.async tiles only."""
    key = max(head_dim, head_dim_v)
    if windowed and key in _TILE_PREFERENCE_WINDOWED:
        tiles = _TILE_PREFERENCE_WINDOWED[key]
    else:
        tiles = _TILE_PREFERENCE[key]
    if paged or not tma:
        tiles = tuple(t for t in tiles if not t.tma)
    if paged and not tma:
        tiles = _PAGED_TILES_WITHOUT_TMA.get(key, ()) + tiles
    return tiles


# Without TMA (SM80/SM86/SM89), paged K/V at head dim 256 runs the two-stage 64x32 tile (the decode tile): the
# row's 64x64 one-stage tile and 64x32 with one stage spilled under the heaviest paged set on sm_80, the two-stage
# one compiles without (benchmarks/results/gate_spill_probes_sm80_s31.jsonl).  SM120 keeps 64x64.
_PAGED_TILES_WITHOUT_TMA: dict[int, tuple[FwdTile, ...]] = {256: (FwdTile(64, 32, 4, 2),)}


# Forward tiles that spill on sm_120a when compiled with dropout (the keep-bit words are live beside the
# accumulators; compile gate), per (head_dim, head_dim_v): dropout there takes the next tile of the preference
# list that is not listed (``dropout_fwd_tile``).  Every other pair keeps the tile of the path without dropout.
_DROPOUT_SPILLING_TILES: dict[tuple[int, int], tuple[FwdTile, ...]] = {
    (192, 128): (FwdTile(128, 64, 8, 1, True, True),),
    (256, 256): (FwdTile(64, 64, 4, 1, False),),
}


# Without TMA (SM80/SM86/SM89), dropout at head dim 192 runs a 32-key cp.async tile: the row's 128x64 one-stage tile
# spilled with dropout under the heaviest feature set on sm_80, the 128x32 two-stage one did not
# (benchmarks/results/gate_sm8x_probe.jsonl).  At 256 the 64x64 and 64x32 one-stage tiles spilled 2-9 STL/LDL with
# dropout on sm_80 (heaviest set, high-p test too), the 64x16 one compiles with 0, packed rows included
# (gate_spill_probes_sm80_s31.jsonl).  Where it does not fit the copy (dv = 32, 96 at 256), the row's tile stays.
_DROPOUT_TILES_WITHOUT_TMA: dict[int, tuple[FwdTile, ...]] = {192: (FwdTile(128, 32, 8, 2),),
                                                              256: (FwdTile(64, 16, 4, 1),)}


def dropout_fwd_tile(head_dim: int, head_dim_v: int, tile: FwdTile, tma: bool = True) -> FwdTile:
    """The forward tile of a dropout call whose path without dropout uses ``tile`` (``tma``: as candidate_tiles)."""
    if not tma:
        for cand in _DROPOUT_TILES_WITHOUT_TMA.get(max(head_dim, head_dim_v), ()):
            if not fwd_tile_problems(head_dim, head_dim_v, cand):
                return cand
    bad = _DROPOUT_SPILLING_TILES.get((head_dim, head_dim_v), ())
    if tile not in bad:
        return tile
    for cand in _TILE_PREFERENCE[max(head_dim, head_dim_v)]:
        if cand not in bad and (tma or not cand.tma) and not fwd_tile_problems(head_dim, head_dim_v, cand):
            return cand
    raise ValueError(f"head_dim={head_dim}, head_dim_v={head_dim_v}: no forward tile without register spills "
                     "for dropout")


# Block sparsity, causal/window or not: the warp-specialised TMA kernel (its producer loads the listed KV tiles) on
# the 128-query-row tiles, whose shapes are those of the cp.async tiles sparse calls ran before (so the same block
# sizes stay valid: 128x128 at d <= 64, 128x64 at d96/d128); then the cp.async tile of the same shape.  At d192 the
# TMA tile (128x64, one stage; Q from shared memory where Q in registers is over the register estimate, dv192, as
# in _TILE_PREFERENCE) runs the block sizes it divides, the cp.async 128x32 tile the others (kv_block an odd
# multiple of 32), so every block size valid before still is.  d256 keeps the cp.async kernel on a narrow KV tile:
# its per-block index lookups cost registers (the sm_120a compile gate spilled with the 1-stage 64x64 tile and with
# the 1-stage 64x32 one under the heaviest feature set; the 2-stage 64x32 tile compiles without spills).
_TILE_PREFERENCE_SPARSE: dict[int, tuple[FwdTile, ...]] = {
    32: (FwdTile(128, 128, 8, 2, True, True), FwdTile(128, 128, 8, 2, True)),
    64: (FwdTile(128, 128, 8, 2, True, True), FwdTile(128, 128, 8, 2, True)),
    96: (FwdTile(128, 64, 8, 2, True, True), FwdTile(128, 64, 8, 2, True)),
    128: (FwdTile(128, 64, 8, 2, True, True), FwdTile(128, 64, 8, 2, True)),
    192: (FwdTile(128, 64, 8, 1, True, True), FwdTile(128, 64, 8, 1, False, True), FwdTile(128, 32, 8, 2)),
    256: (FwdTile(64, 32, 4, 2),),
}
# Score/mask mods with block sparsity: the d <= 64 and d192 TMA tiles with Q in registers spilled on sm_120a with
# the relative-bias score_mod (a 2-D aux table) and the heaviest feature set; Q read from shared memory frees
# the registers that held it, and so they compiled without spills then (the session-30 hand gate lists the d64
# windowed one with the relative-bias mod spilling again: benchmarks/results/gate_hand_sm120a_device_s30.jsonl).
# Same shapes: the same block sizes are valid.  Without TMA (sm_80) the d <= 64 cp.async tile with Q in registers
# spilled the same way and compiles without spills reading Q from shared memory
# (benchmarks/results/gate_spill_probes_sm80_s31.jsonl).
_SPARSE_MODS_TILES = {FwdTile(128, 128, 8, 2, True, True): FwdTile(128, 128, 8, 2, False, True),
                      FwdTile(128, 64, 8, 1, True, True): FwdTile(128, 64, 8, 1, False, True),
                      FwdTile(128, 128, 8, 2, True): FwdTile(128, 128, 8, 2)}


def sparse_tiles(head_dim: int, head_dim_v: int, windowed: bool, tma: bool = True) -> tuple[FwdTile, ...]:
    """The forward tiles a block-sparse call may run, in preference order (those of the sparse list that fit, else
    the cp.async tile); the last one has the finest shape (its multiples are the valid block sizes).  ``tma``: as
    candidate_tiles."""
    tiles = tuple(t for t in _TILE_PREFERENCE_SPARSE.get(max(head_dim, head_dim_v), ())
                  if (tma or not t.tma) and not fwd_tile_problems(head_dim, head_dim_v, t))
    return tiles or (select_fwd_tile(head_dim, head_dim_v, windowed, paged=True),)


def reachable_sparse_tiles(head_dim: int, head_dim_v: int, windowed: bool, tma: bool = True) -> tuple[FwdTile, ...]:
    """The tiles of ``sparse_tiles`` that some block size selects (a tile whose shape is a multiple of an earlier
    one's never is): the ones the compile gate builds."""
    tiles = sparse_tiles(head_dim, head_dim_v, windowed, tma)
    return tuple(t for i, t in enumerate(tiles)
                 if not any(t.tile_m % e.tile_m == 0 and t.tile_n % e.tile_n == 0 for e in tiles[:i]))


def select_sparse_tile(head_dim: int, head_dim_v: int, windowed: bool, mods: bool = False,
                       block_size: tuple[int, int] | None = None, tma: bool = True) -> FwdTile:
    """The tile of a block-sparse call (the same with or without causal/window): the first of ``sparse_tiles``
    whose shape divides ``block_size`` (q_block, kv_block), the finest when none does (the host check then names
    it); the first when ``block_size`` is None.  ``mods``: the call has a score/mask mod (the tile's shape never
    depends on it, so block sizes are checked against the tile without).  ``tma``: as candidate_tiles."""
    tiles = sparse_tiles(head_dim, head_dim_v, windowed, tma)
    tile = tiles[0]
    if block_size is not None:
        fits = [t for t in tiles if block_size[0] % t.tile_m == 0 and block_size[1] % t.tile_n == 0]
        tile = fits[0] if fits else tiles[-1]
    return _SPARSE_MODS_TILES.get(tile, tile) if mods else tile


def paged_tma_tile(head_dim: int, head_dim_v: int, windowed: bool, page_size: int | None = None,
                   tma: bool = True) -> FwdTile | None:
    """The TMA tile a paged prefill call runs (kernels/fwd_tma.py, one TMA box of tile_n rows per K/V tile, from
    the page the table names), or None (the cp.async tile of ``select_fwd_tile(..., paged=True)``): the tile of
    the same call on contiguous K/V when it is a TMA tile and every K/V tile lies inside one page
    (``page_size % tile_n == 0``; ``page_size=None``: whatever the page size, for the compile gate).  The page
    size stays a runtime value: it is not part of the compile key.  ``tma``: the device has TMA (else None)."""
    tile = select_fwd_tile(head_dim, head_dim_v, windowed, tma=tma)
    if not tile.tma or (page_size is not None and (page_size < 1 or page_size % tile.tile_n != 0)):
        return None
    if tile in _PAGED_TMA_SPILLING.get((head_dim, head_dim_v), ()):
        return None
    return tile


# Paged TMA tiles that spill on sm_120a under the heaviest paged feature set (the page walk's addressing beside the
# contiguous tile's registers; benchmarks/results/gate_full_sm_120a.jsonl of session 31, both dtypes): such calls
# take the cp.async paged tile.
_PAGED_TMA_SPILLING: dict[tuple[int, int], tuple[FwdTile, ...]] = {(64, 32): (FwdTile(256, 64, 8, 2, False, True),)}


def select_fwd_tile(head_dim: int, head_dim_v: int, windowed: bool, paged: bool = False, tma: bool = True) -> FwdTile:
    """The tile the dispatcher uses for this head-dim pair; raises ValueError when none fits SM120.  ``tma``: the
    device has TMA (device.DeviceCaps.tma; without it the cp.async tiles of the same row).
    Memoised (it depends on the configuration only); ``clear_caches()`` resets it after a table edit."""
    return _select_fwd_tile(head_dim, head_dim_v, bool(windowed), bool(paged), bool(tma), _TABLE_VERSION[0])


_TABLE_VERSION = [0]


def clear_caches() -> None:
    """Forget memoised tile choices and dispatch plans (tests and sweeps that edit the tile tables call this,
    before and after the edit)."""
    _TABLE_VERSION[0] += 1


def table_version() -> int:
    """Part of every memoisation key that depends on the tile tables."""
    return _TABLE_VERSION[0]


@functools.lru_cache(maxsize=None)
def _select_fwd_tile(head_dim: int, head_dim_v: int, windowed: bool, paged: bool, tma: bool, _version: int) -> FwdTile:
    reasons = []
    for tile in candidate_tiles(head_dim, head_dim_v, windowed, paged, tma):
        problems = fwd_tile_problems(head_dim, head_dim_v, tile)
        if not problems:
            return tile
        reasons.append(f"{tile.name()}: {'; '.join(problems)}")
    raise ValueError(
        f"head_dim={head_dim}, head_dim_v={head_dim_v}: no forward tile fits SM120's limits "
        f"({SMEM_LIMIT_BYTES} B smem, {MAX_REGS_PER_THREAD} registers/thread): " + " | ".join(reasons)
    )


def supported_head_dim_pairs() -> list[tuple[int, int]]:
    """(head_dim, head_dim_v) pairs served: head_dim_v <= head_dim, both from HEAD_DIMS, when a tile fits."""
    return list(_supported_head_dim_pairs(_TABLE_VERSION[0]))


@functools.lru_cache(maxsize=None)
def _supported_head_dim_pairs(_version: int) -> tuple[tuple[int, int], ...]:
    pairs = []
    for d in HEAD_DIMS:
        for dv in HEAD_DIMS:
            if dv > d:
                continue
            try:
                select_fwd_tile(d, dv, False)
            except ValueError:
                continue
            pairs.append((d, dv))
    return tuple(pairs)



# Split-KV on the d=256 64x64 one-stage tile spills on sm_120a (heaviest feature set, compile gate): the runtime
# split index in the block plan is a few registers past the 255 this tile already uses.  Split calls on that tile
# run the 64x32 tile of the same table row instead, which compiles without spills.
SPLIT_TILE_FALLBACK = {FwdTile(64, 64, 4, 1, False): FwdTile(64, 32, 4, 1, False)}


def split_tile(tile: FwdTile) -> FwdTile:
    """The tile a split-KV call runs for ``tile`` (the same one unless it spills with split-KV)."""
    return SPLIT_TILE_FALLBACK.get(tile, tile)


# Score/mask mods on the d=256 cp.async tiles (which use all 255 registers without them) spilled on sm_120a with
# aux tensors and the heaviest feature set (document, ALiBi, relative bias; compile gate): calls with mods run a
# 64x16 tile there (fewer S/P registers per thread).  16 key rows do not divide the V copy at dv = 32 / 96
# (fwd_tile_problems): those take 64x32, which compiles without spills at d256/dv32 but spilled at d256/dv96 (as
# did 64x64), so mods are refused at d256/dv96 (``_MODS_SPILLING``).
MODS_TILE_FALLBACK = {FwdTile(64, 64, 4, 1, False): (FwdTile(64, 16, 4, 1, False), FwdTile(64, 32, 4, 1, False)),
                      FwdTile(64, 32, 4, 1, False): (FwdTile(64, 16, 4, 1, False), FwdTile(64, 32, 4, 1, False))}
_MODS_SPILLING = {(256, 96, FwdTile(64, 32, 4, 1, False))}


def mods_tile(tile: FwdTile, head_dim: int, head_dim_v: int) -> FwdTile:
    """The tile a call with score/mask mods runs for ``tile`` (the tile of the same call without mods);
    ValueError where no fallback tile fits and compiles without spills."""
    cands = MODS_TILE_FALLBACK.get(tile)
    if cands is None:
        return tile
    for cand in cands:
        if not fwd_tile_problems(head_dim, head_dim_v, cand) and (head_dim, head_dim_v, cand) not in _MODS_SPILLING:
            return cand
    raise ValueError(f"score_mod/mask_mod at head_dim={head_dim}, head_dim_v={head_dim_v}: no forward tile "
                     "compiles without register spills on SM120 with mods (64x16 does not fit the V copy, 64x32 "
                     "and 64x64 spill); use another head_dim_v or no mods")


# Score/mask mods and dropout together: the forward tiles of either feature alone spilled on sm_120a with both in
# the heaviest set (relative-bias score_mod reading a 2-D aux table, every flag, seed tensor; compile gate): the
# keep-bit words and the aux reads both need registers beside the accumulators (d64 256x64 and windowed 128x128
# TMA, d192 128x64 TMA and the d192 cp.async tiles down to 64x32, d256 64x16).  These compile without spills
# (benchmarks/results/gate_hand_sm120a_device_s30.jsonl has their mods + dropout configurations): the d128 TMA
# tile for d <= 128, the 64x16 cp.async tile at d192, and where 16 key rows do not divide the copy (dv 32 / 96)
# the d192 TMA tile (at dv96, which has fewer O registers than dv192).  d = 256 has no such tile (64x16 is the
# narrowest), so dropout with mods is refused there.
MODS_DROPOUT_TILES: dict[int, tuple[FwdTile, ...]] = {
    32: (FwdTile(128, 64, 8, 2, True, True),), 64: (FwdTile(128, 64, 8, 2, True, True),),
    96: (FwdTile(128, 64, 8, 2, True, True),), 128: (FwdTile(128, 64, 8, 2, True, True),),
    192: (FwdTile(64, 16, 4, 1, False), FwdTile(128, 64, 8, 1, False, True)),
}
MODS_DROPOUT_MAX_HEAD_DIM = max(MODS_DROPOUT_TILES)
# Without TMA (sm_80 cubins) the d192 64x16 one-stage tile spilled with packed GQA rows (relative bias, every flag:
# the sm_80 full run of 7c4925a); with two K/V stages it compiles without spills, packed or not, and in fewer
# registers (benchmarks/results/gate_spill_probes_sm80_s33.jsonl).  Same shape: the same calls fit it.
_MODS_DROPOUT_TILES_WITHOUT_TMA: dict[int, tuple[FwdTile, ...]] = {192: (FwdTile(64, 16, 4, 2, False),)}


def mods_dropout_fwd_tile(head_dim: int, head_dim_v: int, tma: bool = True) -> FwdTile:
    """The forward tile of a call with score/mask mods and in-kernel dropout; ValueError where none exists
    (``tma``: the device has TMA; the table's d <= 128 tiles are TMA tiles only)."""
    key = max(head_dim, head_dim_v)
    for tile in (() if tma else _MODS_DROPOUT_TILES_WITHOUT_TMA.get(key, ())) + MODS_DROPOUT_TILES.get(key, ()):
        if (tma or not tile.tma) and not fwd_tile_problems(head_dim, head_dim_v, tile):
            return tile
    if not tma and max(head_dim, head_dim_v) <= MODS_DROPOUT_MAX_HEAD_DIM:
        raise ValueError(f"dropout_p > 0 with score_mod/mask_mod at head_dim={head_dim}, head_dim_v={head_dim_v} "
                         "runs only on a TMA tile, and this device has no TMA (SM80/SM86/SM89); use dropout_p=0 or "
                         f"no mods there, or head dim 192 ({MODS_DROPOUT_TILES[192][0].name()} cp.async tile)")
    raise ValueError(f"dropout_p > 0 with score_mod/mask_mod needs max(head_dim, head_dim_v) <= "
                     f"{MODS_DROPOUT_MAX_HEAD_DIM} on SM120 (head_dim={head_dim}, head_dim_v={head_dim_v}: every "
                     "forward tile spills registers with both); use dropout_p=0 or no mods at this head dim")
