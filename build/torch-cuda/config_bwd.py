"""Host-only configuration of the backward kernels: the compile keys, tile tables and resource budgets of the
dK/dV kernel (kernels/bwd_dkdv.py), the dQ kernel (kernels/bwd_dq.py) and the preprocess kernel
(kernels/bwd_preprocess.py).  (Their compile-gate worklists: scripts/gate_lists.py.)

Split from ``config`` (forward, decode, split-KV combine), whose names it uses; the sweep scripts edit the tile
tables here (``config_bwd._BWD_TILES``, ``_DQ_TILES``) in place.  Nothing here imports CuTe-DSL.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .config import SMEM_LIMIT_BYTES, copy_threads_per_row


# ---- backward ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BwdKernelConfig:
    """Compile key of the backward dK/dV kernel (kernels/bwd_dkdv.py, or kernels/bwd_dkdv_kvrows.py with
    ``kv_rows``); lengths, heads, scales and windows are runtime."""

    dtype: str
    head_dim: int
    head_dim_v: int
    tile_m: int  # queries per block
    tile_n: int  # keys per CTA
    num_warps: int = 8
    windowed: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    seqused_q: bool = False
    seqused_k: bool = False
    has_dropout: bool = False
    dropout_seed_tensor: bool = False
    # block sparsity (kernels/block_sparse.py): a user block is sparse_q_ratio query tiles by sparse_kv_ratio KV
    # tiles of this kernel; 0 = off.  The dK/dV kernel walks the KV-major (transposed) lists, the dQ kernel the
    # forward's (Q-major) lists.
    sparse_q_ratio: int = 0
    sparse_kv_ratio: int = 0
    # dK/dV kernel: key rows per warp in the dV = P^T dO and dK = dS^T Q mmas (16: warps stacked along the keys;
    # 32: two m16 atoms per warp and half the warps along the head dim, which halves the ldmatrix reads of dO and Q)
    kv_warp_rows: int = 16
    # dK/dV kernel (bwd_dkdv.py, not the key-row or V-in-registers tiles): query rows per warp in the S = Q K^T and
    # dP = dO V^T mmas (16: 4 x 2 warps on the 64x128 tile, each reading 16 Q rows and 64 keys of K; 32: 2 x 4, 32
    # rows and 32 keys, 64 KB of ldmatrix reads per block instead of 80).  dQ = dS K keeps the 16-row grid (it reads
    # dS from shared memory, and the fp32 workspace and kernels/bwd_dq_convert.py follow that grid's layout)
    # (left out of the repr at 16, ``__repr__``).  32 at d64 measured 1.00x on causal walks and 0.93-0.96x without
    # a window (H200, benchmarks/experiments/results/bwd_qgrid_ab_h200_s38.jsonl): no table selects it
    q_warp_rows: int = field(default=16, repr=False)
    mods: object = None  # modspec.ModSpec (with score_mod_bwd) or None
    # dK/dV kernel (kernels/bwd_dkdv_kvrows.py): S and dP computed transposed, keys as the mma rows (S^T = K Q^T,
    # one warp per 16 keys), so P^T and dS^T go from the accumulators straight into the A operand of dV and dK:
    # no P/dS shared memory, and the freed space double-buffers Q and dO (one CTA barrier per query block)
    kv_rows: bool = False
    # the fused backward (kernels/bwd_dkdv.py): the same CTA also computes dQ = dS K from the dS tile it stages in
    # shared memory and adds it into an fp32 workspace (``red.global.add.v2.f32``, whole 256-byte lines per warp
    # instruction), which kernels/bwd_dq_convert.py scales and casts: 5 GEMMs per block pair instead of the 7 of
    # the dK/dV + dQ kernel pair.  The order of the adds varies from run to run (``deterministic=True`` runs the
    # two-kernel path, or the relay below)
    fused_dq: bool = False
    # the fused backward's deterministic form (``deterministic=True``, kernels/dq_relay.py): the CTAs that add into
    # one query tile's workspace take turns, in the order of their key tiles (a turn counter per query tile, in
    # ``dq_turns``), so the fp32 sums are made in the same order on every run; the CTA walks its query tiles in
    # descending order, each for every query head of the group (RELAY_HEADS_INNER), so the contributors of a tile
    # reach it together.  Only with ``fused_dq``
    dq_relay: bool = False

    def __repr__(self) -> str:
        # the dataclass repr, with q_warp_rows only off its default: the disk compile cache and the prebuilt
        # manifest key on the repr (compile_cache.py, prebuilt.py), and those of the default tiles stay as they were
        # (tests/plan_grid.py compares them too).  Subclasses generate their own repr, without the field
        body = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if f.repr or (f.name == "q_warp_rows" and self.q_warp_rows != 16))
        return f"{type(self).__qualname__}({body})"

    @property
    def block_sparse(self) -> bool:
        return self.sparse_q_ratio > 0

    @property
    def has_aux(self) -> bool:
        return self.mods is not None and bool(self.mods.aux_sig)

    def name(self) -> str:
        flags = [n for n, on in (("win", self.windowed), ("softcap", self.has_softcap), ("vq", self.varlen_q),
                                 ("vk", self.varlen_k), ("uq", self.seqused_q), ("uk", self.seqused_k),
                                 (f"sparse{self.sparse_q_ratio}x{self.sparse_kv_ratio}", self.block_sparse),
                                 ("drop", self.has_dropout), ("seedt", self.dropout_seed_tensor),
                                 (f"mods{self.mods.tag() if self.mods is not None else ''}", self.mods is not None))
                 if on]
        return (f"bwd_{self.dtype}_d{self.head_dim}v{self.head_dim_v}_{self.tile_m}x{self.tile_n}w{self.num_warps}"
                + (f"r{self.kv_warp_rows}" if self.kv_warp_rows != 16 else "")
                + (f"q{self.q_warp_rows}" if self.q_warp_rows != 16 else "")
                + ("t" if self.kv_rows else "") + ("f" if self.fused_dq else "") + ("r" if self.dq_relay else "")
                + ("_" + "_".join(flags) if flags else ""))


def bwd_smem_bytes(cfg: BwdKernelConfig, elem_bytes: int = 2) -> int:
    def align(n: int) -> int:
        return (n + 1023) // 1024 * 1024

    q = align(cfg.tile_m * cfg.head_dim * elem_bytes)
    do = align(cfg.tile_m * cfg.head_dim_v * elem_bytes)
    k = align(cfg.tile_n * cfg.head_dim * elem_bytes)
    v = align(cfg.tile_n * cfg.head_dim_v * elem_bytes)
    p = align(cfg.tile_m * cfg.tile_n * elem_bytes)
    if getattr(cfg, "kv_rows", False):  # two stages of Q and dO, no P / dS; with dropout two blocks' dP sums
        return 2 * (q + do) + k + v + (align(2 * cfg.tile_m * 4) if cfg.has_dropout else 0)
    if isinstance(cfg, BwdVRegsKernelConfig):  # V read once into registers; P and dS then take its region; the
        return q + do + k + max(v, 2 * p) + align(2 * cfg.tile_m * 4)  # block's LSE and D per row
    return q + do + k + v + 2 * p


# (tile_m, tile_n, num_warps[, kv_warp_rows[, kv_rows]]) per max(head_dim, head_dim_v), first that fits wins; every
# (wm, wn) warp split must divide the tiles.  128-key tiles stream Q and dO once per 128 keys instead of per 64;
# they and 32 key rows per warp in the dV/dK mmas are kept where the per-kernel sweep found them faster
# (benchmarks/experiments/results/bwd_tile_sweep_h100_v2.jsonl and _v4.jsonl; at d128 the key rows per warp stay
# 16, where 32 was neutral).  The key-row kernel (``kv_rows``, bwd_dkdv_kvrows.py), whose P^T/dS^T stay in
# registers, replaced the tile before it at d64, d96 and d128 and lost at d32, which keeps 64x64
# (benchmarks/experiments/results/bwd_tile_sweep_h100_v5.jsonl, dK/dV kernel device time).  Feature sets that
# spill it (_BWD_SPILLING) run the next tile.
_BWD_TILES = {
    32: ((64, 64, 8),), 64: ((64, 128, 8, 16, True), (64, 128, 8, 32), (64, 64, 8)),
    96: ((64, 128, 8, 16, True), (64, 64, 8)), 128: ((32, 128, 8, 16, True), (32, 128, 8), (64, 64, 8)),
    192: ((32, 64, 8, 32), (32, 64, 8), (64, 64, 8), (32, 64, 4)),
    256: ((32, 32, 4, 32), (32, 32, 4)),
}
# Tiles whose variant with a feature spills registers on sm_120a (compile gate), per (tile, max head dim): such calls
# take the next tile of the table (none left: the call raises before launch).  Block sparsity: 32x32 r32 at d256;
# block sparsity with a mask_mod: 32x128 at d128 (64x64 instead), 32x32 at d256 (a grad-requiring call raises
# there).  (Dropout on the 128-key tiles spilled with the Philox calls of a row unrolled; bwd_dkdv.py loops over
# them there instead.)
_BWD_SPILLING = {
    ((32, 32, 4, 32, False), 256): {"sparse"},
    # spills with the document mask_mod; in fp16 block sparsity alone spills in every feature set (bf16 does not:
    # benchmarks/results/gate_spill_probes_sm120a_s31.jsonl), so an fp16 block-sparse call at d256 that needs grad
    # raises before launch
    ((32, 32, 4, 16, False), 256): {"sparse_mask_mod", "sparse_fp16"},
    # spills with the document mask_mod: 64x64 instead; fp16 dropout with softcap spilled too (the compile gate's
    # class sweep, benchmarks/results/gate_classes_sm120a_shard0_s30.jsonl), and the fused kernel shares the tile
    # the relay form (dq_relay) with mods spilled 2-4 STL/LDL with the causal, sliding-window and document mask mods
    # in the heaviest plain-walk set (benchmarks/results/gate_relay_sm120a_s35.jsonl): such deterministic calls run
    # the kernel pair
    ((32, 128, 8, 16, False), 128): {"sparse_mask_mod", "dropout_softcap", "relay_mods"},
    # the key-row tiles (they use all 255 registers at d128 without features).  32x128 (d128): dropout with
    # softcap, a windowed call with a mod that reads aux tensors (document, relative bias), mods with dropout
    # (relative bias).  64x128 (d64, d96): mods that read aux tensors (relative bias, prefix-LM from a tensor),
    # dropout (d96, bf16 alone and fp16 with every flag).
    # At d128 a sweep of every subset of (window, varlen q, varlen k, seqused q, seqused k) with dropout and with the
    # document / relative-bias / causal mods (bf16, sparse or not) found spills only where varlen k or a seqused is
    # on without varlen q, with dropout or an aux-reading mod ("partial_varlen").
    ((32, 128, 8, 16, True), 128): {"dropout_softcap", "window_aux_mods", "mods_dropout", "partial_varlen"},
    ((64, 128, 8, 16, True), 96): {"aux_mods", "dropout"},
    # the fused backward's d64 tile (config fused_dq): a windowed call with an aux-reading mod (relative bias)
    # spills; such calls take the 64x64 fused tile
    ((64, 128, 8, 16, False), 64): {"aux_mods"},
    ((64, 128, 8, 16, True), 64): {"aux_mods", "dropout"},
    # the fused tile's 2 x 4 dK/dV grid at d128 (64 key rows per warp): bf16 dropout with softcap and the aux-reading
    # mods (document, relative bias) in the heaviest plain-walk set spill on sm_120a and sm_121a (cu12, 101 fused
    # configurations of each: benchmarks/results/gate_fused_kvrows_s37.jsonl); those calls take the 16-row grid
    # (its relay form with mods, unbuilt: RELAY_HEAD_DIMS has no d128, held off as on the 16-row grid)
    ((32, 128, 8, 64, False), 128): {"dropout_softcap", "aux_mods", "relay_mods"},
    # the d64 fused tile's 4 x 2 grid: an aux-reading mod (relative bias, document) on a plain walk spilled 6 STL/LDL,
    # 26 with varlen/seqused (sm_120a, cu12: gate_qgrid_s37.jsonl rows "base_mods" on branch h-qgrid); windowed walks
    # built clean, but one entry serves both: such calls take the 16-row grid's next fallback (64x64)
    ((64, 128, 8, 32, False), 64): {"aux_mods"},
    # the d64 fused tile with its S/dP warps 2 x 4 (q_warp_rows 32; measured, selected by no default table): the
    # aux-reading mods (relative bias, document) spill 2-21 STL/LDL on sm_120a, windowed or not, relay or not; every
    # other set of the fused worklist compiles without (bf16/fp16, d64/dv64 and dv32, heavy flags, dropout, causal
    # mask mod, relay forms: benchmarks/results/gate_qgrid_s37.jsonl)
    ((64, 128, 8, 32, False, 32), 64): {"aux_mods"},
}
# Added on a device without TMA (8.0 / 8.6 / 8.9: they load sm_80 cubins, whose register allocation differs from
# sm_120a's on these 255-register tiles; the sm_80 full run of 7c4925a, benchmarks/results/
# gate_spill_probes_sm80_s33.jsonl holds the spills and the tiles that replaced them):
# * 32x128 key-row tile (d128): an aux-reading mod on a dense call (the document mask mod spilled with varlen q and
#   k, with and without seqused k); the 32x128 P/dS tile of the same shape compiles without.  Block-sparse calls
#   with it compiled without spills and keep the tile.
# * 64x128 key-row tile (d96): fp16 block sparsity (1x1 blocks spilled); the next tile, 64x64, has another shape
#   than the one block_sparse checks the block sizes against, so such a call is refused (``_sparse_shape``).
_BWD_SPILLING_WITHOUT_TMA = {
    ((32, 128, 8, 16, True), 128): {"dense_aux_mods"},
    ((64, 128, 8, 16, True), 96): {"sparse_fp16"},
}
_WITHOUT_TMA = "a device without TMA (compute capability 8.0 / 8.6 / 8.9: A100, RTX 30xx, RTX 40xx)"


def bwd_problems(cfg: BwdKernelConfig, tma: bool = True) -> list[str]:
    """Reasons ``cfg`` cannot run (empty: it can); ``tma``: the device has TMA (device.DeviceCaps.tma), else the
    feature sets that spill on sm_80 (``_BWD_SPILLING_WITHOUT_TMA``) count too."""
    problems = []
    # the S/dP grid joins the key only when it is not the 16-row default, so the keys of the default tiles stay
    tile = (cfg.tile_m, cfg.tile_n, cfg.num_warps, cfg.kv_warp_rows, cfg.kv_rows) + (
        (cfg.q_warp_rows,) if cfg.q_warp_rows != 16 else ())
    q_grid = q_grid_problems(cfg)
    problems += q_grid
    if cfg.kv_rows:
        # one warp per 16 keys, all the block's queries: P^T / dS^T of a warp are whole A operands
        if cfg.tile_n != 16 * cfg.num_warps or cfg.kv_warp_rows != 16:
            problems.append(f"key-row tile needs tile_n = 16 x num_warps and 16 key rows per warp, got tile_n="
                            f"{cfg.tile_n}, {cfg.num_warps} warps, {cfg.kv_warp_rows} rows")
    if cfg.dq_relay and not cfg.fused_dq:
        problems.append("the dQ relay (dq_relay) orders the fused kernel's dQ adds: it needs fused_dq")
    if isinstance(cfg, BwdVRegsKernelConfig):
        problems += vregs_problems(cfg)
    spilling = _BWD_SPILLING.get((tile, max(cfg.head_dim, cfg.head_dim_v)), set())
    if not tma:
        spilling = spilling | _BWD_SPILLING_WITHOUT_TMA.get((tile, max(cfg.head_dim, cfg.head_dim_v)), set())
    mask_mod = cfg.mods is not None and cfg.mods.has_mask_mod
    for feature, on in (("dropout", cfg.has_dropout), ("sparse", cfg.block_sparse),
                        ("dense_aux_mods", cfg.has_aux and not cfg.block_sparse),
                        ("sparse_mask_mod", cfg.block_sparse and mask_mod),
                        ("sparse_fp16", cfg.block_sparse and cfg.dtype == "fp16"),
                        ("dropout_softcap", cfg.has_dropout and cfg.has_softcap),
                        ("aux_mods", cfg.has_aux), ("window_aux_mods", cfg.windowed and cfg.has_aux),
                        ("mods_dropout", cfg.has_dropout and cfg.mods is not None),
                        ("relay_mods", cfg.dq_relay and cfg.mods is not None),
                        ("partial_varlen", (cfg.has_dropout or cfg.has_aux) and not cfg.varlen_q
                         and (cfg.varlen_k or cfg.seqused_q or cfg.seqused_k))):
        if on and feature in spilling:
            problems.append(f"backward tile spills registers with {feature} on {'sm_120a' if tma else 'sm_80'}")
    smem = bwd_smem_bytes(cfg)
    if smem > SMEM_LIMIT_BYTES:
        problems.append(f"backward needs {smem} B of shared memory > SM120 limit {SMEM_LIMIT_BYTES} B")
    # (rows, columns, rows per warp) of each grid: S/dP (tile_n columns) on the q_warp_rows grid, dQ (head_dim
    # columns) on the 16-row one, dV/dK on the key rows (an unbuildable S/dP grid is reported by q_grid_problems)
    grids = [(cfg.tile_m, (cfg.head_dim,), 16), (cfg.tile_n, (cfg.head_dim, cfg.head_dim_v), cfg.kv_warp_rows)]
    if cfg.q_warp_rows == 16:
        grids[0] = (cfg.tile_m, (cfg.tile_n, cfg.head_dim), 16)
    elif not q_grid:
        grids.append((cfg.tile_m, (cfg.tile_n,), cfg.q_warp_rows))
    for rows, ns, per_warp in grids:
        wm = min(rows // per_warp, cfg.num_warps)
        wn = cfg.num_warps // wm
        for n in ns:
            if n % (wn * 16) != 0:
                problems.append(f"backward warp split {wm}x{wn} does not divide {n}")
    threads = cfg.num_warps * 32
    for dim in (cfg.head_dim, cfg.head_dim_v):
        rows_per_pass = threads // copy_threads_per_row(dim, 16)
        for rows in (cfg.tile_m, cfg.tile_n):
            if rows % rows_per_pass != 0:
                problems.append(f"backward tile of {rows} rows is not a multiple of the copy's {rows_per_pass} (d={dim})")
    return problems


def q_grid_problems(cfg: BwdKernelConfig) -> list[str]:
    """Why ``cfg``'s S/dP warp grid (``q_warp_rows``) cannot be built (empty: it can).  Only bwd_dkdv.py's own
    product loop reads the field: the key-row tile (``kv_rows``) puts keys on the mma rows and the V-in-registers
    tile has its own S/dP grid, so both refuse anything but 16.  The rows per warp must be a multiple of the m16
    atom and divide the tile's query rows, with at most ``num_warps`` warps along them."""
    rows = cfg.q_warp_rows
    if rows == 16:
        return []
    problems = []
    if cfg.kv_rows or isinstance(cfg, BwdVRegsKernelConfig):
        problems.append(f"q_warp_rows={rows}: the key-row and V-in-registers tiles have their own S/dP grid (16 only)")
    if rows <= 0 or rows % 16 or cfg.tile_m % rows:
        problems.append(f"q_warp_rows={rows} must be a positive multiple of 16 dividing tile_m={cfg.tile_m}")
    elif cfg.tile_m // rows > cfg.num_warps or cfg.num_warps % (cfg.tile_m // rows):
        problems.append(f"q_warp_rows={rows}: {cfg.tile_m // rows} warps along tile_m={cfg.tile_m} do not split "
                        f"{cfg.num_warps} warps")
    return problems


def select_bwd_config(dtype: str, head_dim: int, head_dim_v: int, tma: bool = True, **flags) -> BwdKernelConfig:
    """The backward kernel configuration; raises ValueError when no tile fits (checked at forward time when
    gradients are required, so a training step never fails half-way).  ``tma``: the device has TMA
    (device.DeviceCaps.tma; without it the sm_80 spill sets count, ``bwd_problems``)."""
    reasons = []
    shape = None if tma or not flags.get("sparse_q_ratio") else _sparse_shape(head_dim, head_dim_v, flags.get("mods"))
    for tm, tn, nw, *rest in _BWD_TILES[max(head_dim, head_dim_v)]:
        rows, kv_rows = (list(rest) + [16, False][len(rest):])[:2]
        cfg = BwdKernelConfig(dtype, head_dim, head_dim_v, tm, tn, nw, kv_warp_rows=rows, kv_rows=kv_rows, **flags)
        problems = bwd_problems(cfg, tma)
        if shape is not None and (tm, tn) != shape:
            problems.append(f"block-sparse lists are checked against the {shape[0]}x{shape[1]} tile")
        if not problems:
            return cfg
        reasons.append(f"{tm}x{tn}w{nw}: " + "; ".join(problems))
    if shape is not None:
        from .compat import refuse

        named = ", ".join(n for n in ("windowed", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k")
                          if flags.get(n))
        refuse("sparse_grad_without_tma", dtype=dtype, d=head_dim, dv=head_dim_v, device=_WITHOUT_TMA,
               flags=f" with {named}" if named else "", mods=" and a score/mask mod" if flags.get("mods") else "",
               tile=f"{shape[0]}x{shape[1]}", reasons=" | ".join(reasons))
    raise ValueError(f"head_dim={head_dim}, head_dim_v={head_dim_v}: no backward tile fits SM120: " + " | ".join(reasons))


def _sparse_shape(head_dim: int, head_dim_v: int, mods) -> tuple[int, int]:
    """(tile_m, tile_n) of the dK/dV tile the TMA table picks for a block-sparse call in bf16 with no other flag:
    the only shape a device without TMA runs (the sm_80 gate builds those; block_sparse._bwd_tiles prepares the
    lists for whatever tile the call selects, so this restricts the choice, it does not keep the lists right)."""
    cfg = select_bwd_config("bf16", head_dim, head_dim_v, sparse_q_ratio=1, sparse_kv_ratio=1, mods=mods)
    return cfg.tile_m, cfg.tile_n


# Causal / windowed backward walks launch their longest key tiles first across every (KV head, batch), not only
# inside one, on grids of at least BWD_LPT_MIN_COLUMNS key tiles and at most BWD_LPT_MAX_PAIRS (KV head, batch)
# pairs (kernels/bwd_dkdv.py ``cta_coords``), as the forward does (config.FWD_LPT_ORDER).  On grids of many pairs
# the order measured much slower (0.69-0.93x with 128-256 pairs), on grids of at most 64 pairs as fast or faster
# (up to 1.10x): benchmarks/experiments/results/lpt_bwd_h100_s33.jsonl.  ``False`` restores the plain order (an A/B
# switch for benchmarks/experiments/probe_lpt_bwd.py; not part of the compile key).
BWD_LPT_ORDER = True
BWD_LPT_MIN_COLUMNS = 16
BWD_LPT_MAX_PAIRS = 64

# The relay form (``dq_relay``, kernels/dq_relay.py): where a CTA passes a query tile's turn on, in its next
# iteration: "top" right after the iteration's first CTA barrier (the adds drain under the next tile's row
# statistics loads), "after_s" after the next tile's S mma (more time to drain before the release's fence, a longer
# wait for the next CTA).  "top" measured 1-4% faster on every cell (H200,
# benchmarks/experiments/results/relay_bwd_h200_s35.jsonl); an A/B switch for
# benchmarks/experiments/probe_relay_bwd.py, not part of the compile key.
DQ_RELAY_RELEASE = "top"
# Head dims (max(head_dim, head_dim_v), as _FUSED_TILES) where ``deterministic=True`` takes the relay form; the rest
# keep the atomic-free dK/dV + dQ pair.  Tests widen it to cover the relay kernel at every fused tile.  Measured in
# one process against the default and the pair (benchmarks/experiments/README.md, probe_relay_bwd.py): the first
# relay (a spin loop inside the walk) beat the pair at d64 only (H200, relay_bwd_h200_s35.jsonl); the one-loop walk
# (kernels/dq_relay.py "One loop", session 39) with a GQA group's heads inner (RELAY_HEADS_INNER, session 40) runs
# relay / default d64 0.80-0.82 against the pair's 0.64-0.73, d128 (llama3-8b, qwen2.5-7b, S 1K/4K) 0.82-0.91
# against 0.74-0.89 (H100, relay_d64_h100_s40.jsonl, relay_hi_*_h100_s40.jsonl); d96 (mha-d96 S=2K) 0.69-0.74
# against the pair's 0.81-0.95, so d96 keeps the pair (relay_d96_h100_s40.jsonl).
RELAY_HEAD_DIMS = frozenset({64, 128})
# The relay's walk order over a GQA group (kernels/bwd_dkdv.py ``dense_entry``): True, each query tile for every
# head of the group (query tiles outer); False, each head's query tiles in turn (heads outer).  With heads outer a
# causal walk's later key tiles, which see fewer query tiles, finish a head first and then wait at the next head's
# first tile for the earlier key tiles: relay / default at d128 S=1K causal GQA 0.68-0.72 heads outer, 0.91 heads
# inner; the other cells within 0.01, or better heads inner (H100, relay_hi_*_h100_s40.jsonl).  An A/B switch for
# benchmarks/experiments/probe_relay_bwd.py, not part of the compile key.
RELAY_HEADS_INNER = True


# The fused backward's tiles per max(head_dim, head_dim_v): ((tile_m, tile_n, num_warps), walks it serves: "all",
# "plain" (no window) or "windowed"),
# first that fits wins: the dK/dV kernel's P/dS tile (kernels/bwd_dkdv.py, not the key-row one, whose P^T/dS^T
# live in registers and would need a further dS tile for dQ), with the dQ mma on the query-row warp grid.  Kept
# only where it measured faster than the dK/dV + dQ kernel pair on the H100 proxy (issue 30's cells, one process,
# benchmarks/experiments/results/bwd_fused_ab_h100_s30.jsonl, last rows): d64 64x128 on every walk; d128 32x128 on walks
# without a window (64x64 lost there) and 64x64 on windowed ones with mods or dropout (32x128 lost there before the
# launch order); since the launch order, 32x128 on windowed walks without mods or dropout, which the order serves: it
# beat 64x64 on the causal llama3-8b cells by the ratios in benchmarks/experiments/results/bwd_fused_tile_h100_s34.jsonl
# (the 64x64 stays where 32x128 was not measured: mods, dropout); d96 64x64 on every walk
# (benchmarks/experiments/results/bwd_fused_ab_d96_h200_s31.jsonl; 64x128 and 128x64 exceed the shared memory at
# d96).  d192 and d256
# (32x32, 4 warps) measured 0.96-0.98x the pair and keep it; d32 was not measured and keeps it.
# The dK/dV products' warp grid (kv_warp_rows, the fourth field): 16 key rows per warp stacks all 8 warps along the
# keys, so each re-reads the whole dO (dV += P^T dO) and Q (dK += dS^T Q) from shared memory, the pipe the
# profiles found busiest (benchmarks/results/bwd_ncu_h200.jsonl: 73-75% against a 38-40% tensor pipe at d128).
# 64 rows at d128 (2 x 4 warps) and 32 at d64 (4 x 2) read dO and Q 2x and 4x instead of 8x: 1.07-1.10x at d128
# and 1.05-1.07x at d64 on the fused A/B cells (H200, one GPU, each variant's process with its own peers:
# benchmarks/experiments/results/bwd_fused_kvrows_h200_s37.jsonl); 32 rows at d128 gained 1.06-1.08x, 64 at d64
# 1.00-1.02x.  Feature sets for which such a grid spills (``_BWD_SPILLING``) and head dims it does not divide take
# the next entry, the 16-row grid.
_FUSED_TILES = {
    64: (((64, 128, 8, 32), "all"), ((64, 128, 8), "all"), ((64, 64, 8), "all")),
    96: (((64, 64, 8), "all"),),
    128: (((32, 128, 8, 64), "plain"), ((32, 128, 8), "plain"), ((32, 128, 8, 64), "windowed-bare"),
          ((32, 128, 8), "windowed-bare"), ((64, 64, 8), "windowed")),
    # the V-in-registers tile below (kernels/bwd_dkdv_vregs.py): 1.06-1.11x the kernel pair on the three d256 cells
    # of bwd_fused_ab (H200, benchmarks/experiments/results/bwd_fused_ab_vregs_d256_h200_s36.jsonl)
    256: (((32, 64, 8, 32, "vregs"), "all"),),
}


# ---- the fused backward's V-in-registers tile (kernels/bwd_dkdv_vregs.py) -----------------------------------
# At max(d, dv) = 256 the P/dS tile of bwd_dkdv.py fits SM120's shared memory only as 32x32 with 4 warps, whose dK,
# dV and dQ accumulators (32 key rows x 256 each, and 32 query rows x 256) leave too few of 255 registers.  This
# tile keeps 64 keys per CTA with 8 warps, reads V once into registers (its only reader is dP = dO V^T) and stages
# P and dS in V's shared memory.  S and dP put the 8 warps side by side along the keys (8 keys x 32 query rows
# each), which halves a warp's share of V against the 2 x 4 query-row grid (16 keys each: 64 registers, which
# spilled); dK/dV and dQ run in column chunks (``vregs_chunk_cols``; dQ in 64-column chunks without dropout), so
# one chunk's dQ and operands are live at a time.  Budget at d = dv = 256, 32x64, 8 warps, 16-bit inputs:
#
#   shared memory                                  bytes  | registers per thread (256 threads, 255 max)       regs
#   Q      32 x 256                                16384  | dK accumulator, 64 keys x 256 / 256 threads          64
#   dO     32 x 256                                16384  | dV accumulator                                       64
#   K      64 x 256                                32768  | V (8 keys x 256 per warp)                            32
#   V      64 x 256, then P and dS (2 x 32 x 64)   32768  |   persistent                                       160
#   LSE and D of the block's 32 rows (fp32)         1024  | S, P, dP of a warp's 32 x 8                      3 x 8
#   total                                          99328  | dQ, one 64-column chunk (16 rows x 16 per warp)      8
#   limit                                         101376  | one k16 step of a dK/dV chunk (A 8 + B 8), x2       32
#   (P and dS beside V: 106496, over the limit)           | (LSE, D and positions of the 4 rows: on use, not held)
# The compile gate measured 238-255 registers at d256/dv256 and 179-218 at d256/dv64 (the walk's indices,
# addresses and ptxas's prefetching take the rest) and 0 spills on every feature set of scripts/gate_lists.py
# ``fused_trial_worklist`` (benchmarks/results/gate_vregs_sm120a_d256.jsonl); its relay form spilled (rows
# "relay_probe"), so ``vregs_problems`` refuses it.
@dataclass(frozen=True)
class BwdVRegsKernelConfig(BwdKernelConfig):
    """Compile key of the fused backward's V-in-registers tile (kernels/bwd_dkdv_vregs.py): the fields of
    ``BwdKernelConfig``; its own type, so that the configurations of the other tiles keep their keys."""

    def name(self) -> str:
        return "bwdvr" + super().name()[3:]


def vregs_chunk_cols(dim: int) -> int:
    """Columns per chunk of the V-in-registers tile's products over a head dim of ``dim``: 128 where it divides,
    else 64 (the warp grids' column permutation is 64 wide)."""
    return 128 if dim % 128 == 0 else 64


def vregs_problems(cfg: BwdKernelConfig) -> list[str]:
    """Why the V-in-registers tile cannot take ``cfg`` (empty: it can): it is a fused tile only (its P/dS staging
    serves the dQ product), walks the dense lists only, and needs 8 warps: S and dP with every warp on all query
    rows and 8 keys of every 64 (``tile_n`` a multiple of 64), dQ on the 16-row query grid (``tile_m`` a multiple
    of 16), dV and dK with 16 or 32 key rows per warp (the default d256 tile: 32x64, 32 rows)."""
    problems = []
    if not cfg.fused_dq:
        problems.append("the V-in-registers tile is a fused tile (fused_dq)")
    if cfg.block_sparse:
        problems.append("the V-in-registers tile walks no block-sparse lists")
    if cfg.kv_rows:
        problems.append("the V-in-registers tile computes S with query rows (kv_rows off)")
    if cfg.num_warps != 8:
        problems.append(f"the V-in-registers tile has 8 warps, got {cfg.num_warps}")
    if cfg.tile_n % (8 * cfg.num_warps) or cfg.tile_m % 16 or cfg.tile_m <= 0:
        problems.append(f"the V-in-registers tile needs tile_n a multiple of 8 x warps (8 keys per warp and mma "
                        f"repeat) and tile_m a multiple of 16, got {cfg.tile_m}x{cfg.tile_n}w{cfg.num_warps}")
    if cfg.kv_warp_rows not in (16, 32):
        problems.append(f"the V-in-registers tile takes 16 or 32 key rows per warp in dV/dK, got {cfg.kv_warp_rows}")
    for dim in (cfg.head_dim, cfg.head_dim_v):
        if dim % 64:
            problems.append(f"the V-in-registers tile needs head dims that are multiples of 64, got {dim}")
    if cfg.dq_relay:  # its relay form spilled 6-10 STL/LDL on sm_120a in windowed and varlen sets
        # (benchmarks/results/gate_vregs_sm120a_d256.jsonl, rows "relay_probe"): deterministic=True runs the pair
        problems.append("the V-in-registers tile has no relay form (dq_relay): it spills registers on sm_120a")
    return problems


# Fused tiles built and gated but not selected by default, so that they can be measured first: (tile_m, tile_n,
# num_warps, kv_warp_rows, "vregs"), walks as ``_FUSED_TILES``.  ``select_fused_config`` tries them before the
# default table where ``trial`` is on: by argument, or for the head dims named in the environment variable
# ``FUSED_TRIAL_ENV`` (comma-separated max(d, dv), e.g. ``FA4_SM120_BWD_FUSED_TRIAL=256``; read when a plan is
# built, so set it before the first call), the switch the A/B probes and the GPU tests use.
# Empty: the d256 V-in-registers tile was measured and moved to _FUSED_TILES.  Session 38 tried that tile at d64
# (64x128) and d128 (64x64 as FROST's, and 32x128) as trials: every set of the fused trial worklist compiled without
# spills on sm_120a, 311 GPU tests passed with the trial switch on (H100; the run stopped at its time limit, and its 3
# failures were relay tests expecting d64's relay form, which this tile lacks), and it lost to the default tiles on
# bwd_fused_ab's cells (H100, one process per variant, the compile gate running beside: d64 0.88-0.92x, d128 64x64
# 0.68-0.81x, 32x128 0.87-0.91x; benchmarks/experiments/results/bwd_vregs_d64_d128_ab_h100_s38.jsonl), so no table
# selects it there.
_FUSED_TRIAL_TILES: dict = {}
FUSED_TRIAL_ENV = "FA4_SM120_BWD_FUSED_TRIAL"


def _trial_on(head_dim: int) -> bool:
    import os

    named = os.environ.get(FUSED_TRIAL_ENV, "")
    return str(head_dim) in {x.strip() for x in named.split(",")}


def _fused_tile_config(dtype: str, head_dim: int, head_dim_v: int, tile: tuple, flags: dict) -> BwdKernelConfig:
    """The configuration of one fused-table entry (tile_m, tile_n, num_warps[, kv_warp_rows[, tags...]]); tags:
    "vregs" (the V-in-registers tile) and "q<n>" (``q_warp_rows`` = n, e.g. "q32").  ValueError on another tag."""
    tm, tn, nw, *rest = tile
    rows = rest[0] if rest else 16
    cls, q_rows = BwdKernelConfig, 16
    for tag in rest[1:]:
        if tag == "vregs":
            cls = BwdVRegsKernelConfig
        elif isinstance(tag, str) and tag[:1] == "q" and tag[1:].isdigit():
            q_rows = int(tag[1:])
        else:
            raise ValueError(f"fused tile tag {tag!r} is neither 'vregs' nor 'q<rows>' (e.g. 'q32')")
    return cls(dtype, head_dim, head_dim_v, tm, tn, nw, kv_warp_rows=rows, q_warp_rows=q_rows, fused_dq=True,
               **flags)


def select_fused_config(dtype: str, head_dim: int, head_dim_v: int, trial: bool | None = None,
                        **flags) -> BwdKernelConfig | None:
    """The fused backward's configuration (``fused_dq``), or None where the dK/dV + dQ kernel pair runs the call:
    a head dim or walk without a fused tile (``_FUSED_TILES``), a feature set that spills every fused tile
    (``bwd_problems``).  Never with a learnable sink (its gradient reads per-row sums of P dP that only the dQ
    kernel makes) or block sparsity (the callers keep those off).  ``trial``: try the tiles of
    ``_FUSED_TRIAL_TILES`` first (None: where ``FUSED_TRIAL_ENV`` names the head dim)."""
    walk = "windowed" if flags.get("windowed") else "plain"
    # "windowed-bare": a windowed walk without mods or dropout, the calls the launch order serves (BWD_LPT_ORDER)
    bare = walk == "windowed" and not flags.get("mods") and not flags.get("has_dropout")
    dmax = max(head_dim, head_dim_v)
    entries = _FUSED_TILES.get(dmax, ())
    if trial or (trial is None and _trial_on(dmax)):
        entries = _FUSED_TRIAL_TILES.get(dmax, ()) + tuple(entries)
    for tile, walks in entries:
        if walks not in ("all", walk) and not (walks == "windowed-bare" and bare):
            continue
        cfg = _fused_tile_config(dtype, head_dim, head_dim_v, tile, flags)
        if not bwd_problems(cfg):
            return cfg
    return None


_FUSED_FLAGS = ("windowed", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k", "has_dropout",
                "dropout_seed_tensor", "mods")


def fused_for(bwd_cfg: BwdKernelConfig, relay: bool = False) -> tuple[BwdKernelConfig, DqConvertKernelConfig] | None:
    """(fused config, convert config) for the call whose dK/dV kernel pair is ``bwd_cfg``, or None where the pair
    runs it: block sparsity (the KV-major lists are made for the pair's tile) or no fused tile for its head dim,
    walk and features (``select_fused_config``).  ``relay``: the deterministic form (``dq_relay``,
    ``deterministic=True``), on the same tile as the default, where it serves (``relay_serves``).  The caller also
    keeps the pair for a learnable sink and a device without vector reductions."""
    if bwd_cfg.block_sparse:
        return None
    cfg = select_fused_config(bwd_cfg.dtype, bwd_cfg.head_dim, bwd_cfg.head_dim_v,
                              **{f: getattr(bwd_cfg, f) for f in _FUSED_FLAGS})
    if cfg is not None and relay:  # the same tile where the relay serves and compiles on it, else none (the pair)
        cfg = replace(cfg, dq_relay=True)
        if not relay_serves(cfg):
            return None
    return None if cfg is None else (cfg, dq_convert_config(cfg))


def relay_serves(relay_cfg: BwdKernelConfig) -> bool:
    """Whether ``deterministic=True`` runs this relay-form configuration: its head dim is one where the relay beat the
    pair (``RELAY_HEAD_DIMS``) and it compiles without problems (``bwd_problems``: e.g. its spills with mods)."""
    return max(relay_cfg.head_dim, relay_cfg.head_dim_v) in RELAY_HEAD_DIMS and not bwd_problems(relay_cfg)


def dq_turns_offset(accum_elems: int) -> int:
    """Where the relay's turn counters start in the one zeroed fp32 allocation that holds the dQ workspace
    (``accum_elems`` values) and then the counters (int32, one per workspace tile and head): rounded up to 16
    bytes.  One allocation, one memset per call (dispatch_bwd)."""
    return -(-accum_elems // 4) * 4




def dq_accum_blocks(tile_m: int, batch: int, rows_q: int, varlen_q: bool) -> int:
    """Query tiles of the fused backward's fp32 dQ workspace, (blocks, Hq, tile_m * head_dim): dense, ``batch``
    times the tiles of ``rows_q`` positions; varlen (``rows_q`` = total_q), sequence b's tiles start at tile
    cu_seqlens_q[b] // tile_m + b, so they never share a tile with another sequence's (kernels/bwd_dkdv.py)."""
    if varlen_q:
        return rows_q // tile_m + batch + 1
    return batch * -(-rows_q // tile_m)


@dataclass(frozen=True)
class DqConvertKernelConfig:
    """Compile key of the fused backward's dQ convert kernel (kernels/bwd_dq_convert.py): reads the fp32 workspace
    of the fused kernel ``tile_m`` x ``head_dim`` per tile, in the order its query-row mma holds it, scales by the
    softmax scale and stores dQ in ``dtype``."""

    dtype: str
    head_dim: int
    tile_m: int
    num_warps: int
    varlen_q: bool = False
    seqused_q: bool = False
    # SeqInfo's flags of the key side (this kernel touches no keys)
    varlen_k = False
    seqused_k = False

    def name(self) -> str:
        return (f"dqcvt_{self.dtype}_d{self.head_dim}_{self.tile_m}w{self.num_warps}"
                + ("_vq" if self.varlen_q else "") + ("_uq" if self.seqused_q else ""))


def dq_convert_config(fused: BwdKernelConfig) -> DqConvertKernelConfig:
    return DqConvertKernelConfig(fused.dtype, fused.head_dim, fused.tile_m, fused.num_warps, fused.varlen_q,
                                 fused.seqused_q)


# dQ kernel (bwd_dq.py): Q-stationary, warps stacked along M; (tile_m, tile_n, num_warps, kv_stages).  With two
# stages the next K/V block streams in while this one is computed (one barrier per block).  Two stages pay at d64;
# at d128 the two-stage tiles that fit 99 KB (128x32 with 8 warps) lost to the one-stage 128x64, so d >= 128 keep
# one stage (benchmarks/experiments/results/bwd_tile_sweep_h100_v2.jsonl).
# The fifth field, ``split_kv_wait`` (one stage, V and K waited for separately, dP before S), hides K's load
# under the dP mma; kept where it measured faster than the same tile without it, at d128 and d256, not at d192
# (benchmarks/experiments/results/bwd_tile_sweep_h100_v6.jsonl, dQ kernel device time).
_DQ_TILES = {32: (128, 64, 8, 2), 64: (128, 64, 8, 2), 96: (128, 64, 8, 2), 128: (128, 64, 8, 1, True),
             192: (64, 64, 4, 1), 256: (64, 32, 4, 1, True)}


@dataclass(frozen=True)
class DqKernelConfig(BwdKernelConfig):
    """Compile key of the dQ kernel (the dK/dV kernel's fields, plus the number of K/V smem stages)."""

    kv_stages: int = 1
    # one stage, dense walk: V and K in their own cp.async groups, dP computed before S, so K lands under the dP mma
    # and V of the next tile under S, dS and dQ (kernels/bwd_dq.py; three barriers per tile instead of two)
    split_kv_wait: bool = False
    # the per-row sums of P dP in fp32 (D without O's rounding), written to ``pdpsum``: only the learnable sink's
    # gradient reads them, so a call without a sink compiles without them (one FFMA per element less, and one FMUL
    # more with dropout; benchmarks/experiments/results/dq_sink_grad_h100_s28.jsonl)
    sink_grad: bool = False

    def name(self) -> str:
        return ("dq" + super().name()[3:] + (f"_s{self.kv_stages}" if self.kv_stages > 1 else "")
                + ("_kw" if self.split_kv_wait else "") + ("_sinkg" if self.sink_grad else ""))


def dq_problems(cfg: BwdKernelConfig) -> list[str]:
    problems = []
    smem = dq_smem_bytes(cfg)
    if smem > SMEM_LIMIT_BYTES:
        problems.append(f"the dQ kernel needs {smem} B of shared memory > SM120 limit {SMEM_LIMIT_BYTES} B")
    threads = cfg.num_warps * 32
    for dim in (cfg.head_dim, cfg.head_dim_v):
        rows_per_pass = threads // copy_threads_per_row(dim, 16)
        for rows in (cfg.tile_m, cfg.tile_n):
            if rows % rows_per_pass != 0:
                problems.append(f"dQ tile of {rows} rows is not a multiple of the copy's {rows_per_pass} (d={dim})")
    return problems


# On a device without TMA (sm_80 cubins) the d192 64x64 tile spilled with dropout (softcap and every flag at
# dv96, the relative-bias score mod at dv192: the sm_80 full run of 7c4925a); 64x32 with the split K/V wait, the
# d256 tile's shape, compiles without (benchmarks/results/gate_spill_probes_sm80_s33.jsonl).  Dropout calls never
# carry block-sparse lists (compat "dropout_sparse"), so the tile's shape constrains no block size.
_DQ_DROPOUT_TILES_WITHOUT_TMA = {192: (64, 32, 4, 1, True)}


def select_dq_config(dtype: str, head_dim: int, head_dim_v: int, tma: bool = True, **flags) -> DqKernelConfig:
    """The dQ kernel configuration (``tma``: the device has TMA, as select_bwd_config); ValueError when it does
    not fit."""
    tm, tn, nw, stages, *kw = _DQ_TILES[max(head_dim, head_dim_v)]
    if not tma and flags.get("has_dropout"):
        tm, tn, nw, stages, *kw = _DQ_DROPOUT_TILES_WITHOUT_TMA.get(max(head_dim, head_dim_v), (tm, tn, nw, stages, *kw))
    # not with dropout and a mod together: the d128 tile spilled with it (compile gate, sm_120a); dropout alone
    # compiles without spills at d128 and d256, every flag included
    drop_mods = flags.get("has_dropout") and flags.get("mods") is not None
    cfg = DqKernelConfig(dtype, head_dim, head_dim_v, tm, tn, nw, kv_stages=stages,
                         split_kv_wait=bool(kw and kw[0]) and not drop_mods, **flags)
    problems = dq_problems(cfg)
    if problems:
        raise ValueError(f"head_dim={head_dim}, head_dim_v={head_dim_v}: " + "; ".join(problems))
    return cfg


def dq_smem_bytes(cfg: BwdKernelConfig) -> int:
    tm, tn = cfg.tile_m, cfg.tile_n
    stages = getattr(cfg, "kv_stages", 1)

    def align(n: int) -> int:
        return (n * 2 + 1023) // 1024 * 1024

    return (align(tm * cfg.head_dim) + align(tm * cfg.head_dim_v)
            + align(stages * tn * cfg.head_dim) + align(stages * tn * cfg.head_dim_v))



# ---- backward preprocess: D = rowsum(dO * O) -------------------------------------------------------------------
BWD_PRE_VEC = 8  # 16-bit elements per 16-byte vector load
BWD_PRE_THREADS = 128
BWD_PRE_ROWS_PER_GROUP = 4  # rows each group of threads owns (their loads are issued together)


@dataclass(frozen=True)
class BwdPreKernelConfig:
    """Compile key of the backward preprocess kernel (kernels/bwd_preprocess.py): D = rowsum(dO * O) (- dLSE) in
    fp32.  Batch, sequence length, heads and every stride are runtime values (a varlen call is viewed as batch 1),
    so only the dtype, the head dim of V and the optional dLSE make a new kernel."""

    dtype: str  # of dO and O: "bf16" | "fp16"
    head_dim_v: int
    has_dlse: bool = False  # subtract the gradient of the returned LSE

    def name(self) -> str:
        return f"dpsum_{self.dtype}_dv{self.head_dim_v}" + ("_dlse" if self.has_dlse else "")


def bwd_pre_threads_per_row(head_dim_v: int) -> int:
    """Threads sharing one row: the smallest power of two (<= 32) covering the row's 16-byte vectors, so each
    thread loads at most ceil(vectors / 32) vectors of each tensor (one for head_dim_v <= 256); when the vectors
    are not a power of two the row's last lanes idle (e.g. head_dim_v=96: 12 vectors on 16 lanes)."""
    vectors = head_dim_v // BWD_PRE_VEC
    tpr = 1
    while tpr < 32 and tpr < vectors:
        tpr *= 2
    return tpr


def bwd_pre_head_dim_problem(head_dim_v: int) -> str | None:
    """Why the preprocess kernel cannot take this head dim (None: it can)."""
    if head_dim_v <= 0 or head_dim_v % BWD_PRE_VEC or head_dim_v > 512:
        return f"head_dim_v={head_dim_v} must be a positive multiple of {BWD_PRE_VEC} and at most 512"
    return None
