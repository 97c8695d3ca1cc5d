"""Host-only configuration of the decode tiles: calls whose M tile holds few query rows (q_len x the packed GQA
group <= DECODE_MAX_ROWS: decode and speculative decode), split-KV or not, and the key-split variant
(``FwdTile.kv_groups``, kernels/fwd_decode.py).  Split from ``config``, whose names it uses; nothing here imports
CuTe-DSL.
"""

from __future__ import annotations

import functools

from . import config
from .config import FwdTile

# A call whose M tile holds few query rows runs a 64-row, 4-warp cp.async tile with a two-stage K/V pipeline instead
# of the prefill tile, whose 128 rows would be mostly padding: the smaller tile gives twice the CTAs for the same
# bytes and the second stage keeps a load in flight while a tile is computed (decode cases, contiguous and paged,
# d128 and d256: benchmarks/experiments/results/decode_tiles_h100.jsonl, CUDA-graph replays).
DECODE_MAX_ROWS = 64
# Few rows: the same K/V tile and pipeline, the keys split between warp groups (kernels/fwd_decode.py), so no warp
# computes padding rows and every warp streams its share of each tile: rows <= 32 (MQA's 32 packed heads) two
# groups of two warps, rows <= 16 (GQA 4:1 decode) four groups of one warp.  Entries: (most rows, tile), the first
# that holds the call's rows per CTA and fits wins; key-split entries only while DECODE_KEY_SPLIT is on.
#
# The key split made every decode case of the A/B faster or equal, MQA and GQA, contiguous and paged
# (benchmarks/experiments/results/decode_tiles_h100_s25.jsonl, 8-call graphs, % of copy bandwidth); two groups
# for <= 16 rows too tied with four overall (benchmarks/experiments/results/decode_tiles_h200_s25.jsonl).  Deeper
# K/V pipelines for the 32-row tile (4 or 5 stages of 32 keys) measured slower than two stages of 64 keys (same
# files): the MQA calls are not bound by loads in flight.
# ``False`` puts every decode call back on the 64-row tiles (tests and the probe flip it).
DECODE_KEY_SPLIT = True
_DECODE_TILES: dict[int, tuple[tuple[int, FwdTile], ...]] = {
    **{d: ((16, FwdTile(16, 64, 4, 2, kv_groups=4)), (32, FwdTile(32, 64, 4, 2, kv_groups=2)),
           (64, FwdTile(64, 64, 4, 2))) for d in (32, 64, 96, 128)},
    **{d: ((32, FwdTile(32, 32, 4, 2, kv_groups=2)), (64, FwdTile(64, 32, 4, 2))) for d in (192, 256)},
}


def decode_rows(rows: int, grid_ctas: int, num_sms: int) -> int:
    """The row count to pick a decode tile by: the call's ``rows`` per CTA while its grid (``grid_ctas`` CTAs on
    the 64-row tile, splits included) leaves SMs idle, else DECODE_MAX_ROWS: a grid that already fills the GPU
    (the test of splitkv.auto_num_splits) runs the 64-row tile, no key split.  There the key split gains nothing
    and costs paged calls (d128 GQA 4:1 B=64 KV 2K, a 512-CTA grid: benchmarks/results/decode_h100.jsonl)."""
    return DECODE_MAX_ROWS if grid_ctas * 5 >= num_sms * 4 else rows


def decode_tile(head_dim: int, head_dim_v: int, rows: int = DECODE_MAX_ROWS) -> FwdTile | None:
    """The tile of a call with at most ``rows`` (<= DECODE_MAX_ROWS) query rows per CTA, split or not, or None
    (use the prefill tile).  Memoised like config.select_fwd_tile (``config.clear_caches()`` resets it)."""
    return _decode_tile(head_dim, head_dim_v, rows, DECODE_KEY_SPLIT, config.table_version())


@functools.lru_cache(maxsize=None)
def _decode_tile(head_dim: int, head_dim_v: int, rows: int, key_split: bool, _version: int) -> FwdTile | None:
    for most, tile in _DECODE_TILES.get(max(head_dim, head_dim_v), ()):
        if (rows <= most and (key_split or tile.kv_groups == 1)
                and not config.fwd_tile_problems(head_dim, head_dim_v, tile)):
            return tile
    return None


def decode_tiles(head_dim: int, head_dim_v: int) -> tuple[FwdTile, ...]:
    """Every decode tile of this head-dim pair's table that fits, key-split ones included whether DECODE_KEY_SPLIT
    is on or not (the compile gate builds them all)."""
    return tuple(tile for _, tile in _DECODE_TILES.get(max(head_dim, head_dim_v), ())
                 if not config.fwd_tile_problems(head_dim, head_dim_v, tile))
