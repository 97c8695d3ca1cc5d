"""Key-split decode tiles (kernels/fwd_decode.py: each K/V tile's keys split between warp groups, merged in the
epilogue) on a GPU, against the fp32 reference with test_fwd_gpu's bar.

Each row bucket of config_decode._DECODE_TILES (16 rows: four groups; 32 rows: two groups; 64 rows: none) at head
dims 64 to 256, split (forced and automatic) and not, paged (NaN-filled pools, random page permutation) and contiguous,
with key counts that leave whole groups of a tile without a key (1, 17, 113), empty sequences, every mask,
softcap and a learnable sink.  A spy on the dispatcher checks that the tile meant for the call really ran.
"""

import pytest
import torch

from test_fwd_gpu import _compare
from test_paged_gpu import Paged, _rand, _ref_rows, check_dense_q

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


@pytest.fixture(autouse=True)
def key_split_on(monkeypatch):
    """Every test here runs with the key-split decode tiles on (config_decode.DECODE_KEY_SPLIT, the release
    default), whatever the switch says."""
    from flash_attn_4_sm120 import config, config_decode

    monkeypatch.setattr(config_decode, "DECODE_KEY_SPLIT", True)
    config.clear_caches()
    yield
    config.clear_caches()


@pytest.fixture
def ran_tiles(monkeypatch):
    """The forward configurations compiled or fetched by the calls of a test (dispatch._kernel)."""
    from flash_attn_4_sm120 import dispatch, plan as P

    seen = []
    real = dispatch._kernel

    def spy(cfg, dev):
        seen.append(cfg)
        return real(cfg, dev)

    monkeypatch.setattr(dispatch, "_kernel", spy)
    for entry in P._PLANS.values():  # plans keep their compiled function: make every call fetch it again
        plan = entry[1] if isinstance(entry, tuple) else entry  # a memoised (variant key, plan) pair
        monkeypatch.setattr(plan, "fwd_fn", None)
    return seen


def _expect_groups(seen, groups):
    fwd = [c for c in seen if hasattr(c, "tile") and hasattr(c.tile, "kv_groups")]
    assert fwd and all(c.tile.kv_groups == groups for c in fwd), [c.name() for c in fwd]


def _dense_check(out, lse, q, k, v, lens=None, **kw):
    refs, lses, pts = [], [], []
    for b in range(q.shape[0]):
        n = k.shape[1] if lens is None else lens[b]
        r, l_, p = _ref_rows(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], kw)
        refs.append(r), lses.append(l_), pts.append(p)
    _compare(out, lse, torch.cat(refs), torch.cat(lses), torch.cat(pts))


# (hq, hkv, sq) -> rows per CTA = sq * hq / hkv (packed): 4 and 16 take four groups, 32 two, 64 none
ROWS = [(8, 2, 1, 4), (32, 8, 2, 4), (16, 1, 1, 4), (32, 1, 1, 2), (8, 1, 4, 2), (32, 1, 2, 1)]


@pytest.mark.parametrize("hq,hkv,sq,groups", ROWS)
@pytest.mark.parametrize("sk", [1, 17, 113, 1023])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_key_split_contiguous(hq, hkv, sq, groups, sk, num_splits, ran_tiles):
    g = torch.Generator(device="cuda").manual_seed(sk * 13 + hq + sq)
    q = _rand(2, sq, hq, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(2, sk, hkv, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(2, sk, hkv, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, return_lse=True)
    _dense_check(out, lse, q, k, v, causal=True)
    _expect_groups(ran_tiles, groups)


@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 64), (192, 128), (192, 192), (256, 256), (256, 128)])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (32, 1)])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_decode_key_split_head_dims(d, dv, hq, hkv, num_splits, ran_tiles):
    g = torch.Generator(device="cuda").manual_seed(d + dv + hq)
    lens = [700, 0, 33]
    q = _rand(3, 1, hq, d, dtype=torch.bfloat16, gen=g)
    k = _rand(3, 700, hkv, d, dtype=torch.bfloat16, gen=g)
    v = _rand(3, 700, hkv, dv, dtype=torch.bfloat16, gen=g)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=num_splits, return_lse=True)
    _dense_check(out, lse, q, k, v, lens=lens)
    from flash_attn_4_sm120 import config_decode

    groups = config_decode.decode_tile(d, dv, hq // hkv).kv_groups  # d96: 32 rows (its copy covers 32 per pass)
    assert groups > 1
    _expect_groups(ran_tiles, groups)


@pytest.mark.parametrize("mask", ["none", "causal", "win_64_0", "win_32_16", "causal_left_77"])
@pytest.mark.parametrize("softcap,sink", [(0.0, False), (30.0, True), (0.0, True)])
@pytest.mark.parametrize("num_splits", [1, 7])
@pytest.mark.parametrize("hq,sq", [(32, 1), (8, 1), (8, 3)])
def test_decode_key_split_paged_masks_softcap_sink(mask, softcap, sink, num_splits, hq, sq):
    causal = mask.startswith("causal")
    window = {"none": (None, None), "causal": (None, None), "win_64_0": (64, 0), "win_32_16": (32, 16),
              "causal_left_77": (77, None)}[mask]
    lens = [333, 17, 0, 129]
    pg = Paged(lens, 16, 1, 128, 128, seed=hq + sq)
    g = torch.Generator(device="cuda").manual_seed(hq * 3 + sq)
    q = _rand(4, sq, hq, 128, dtype=torch.bfloat16, gen=g) * (3 if softcap else 1)
    s = torch.randn(hq, device="cuda", generator=g) * 2 if sink else None
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=causal,
                                         window_size=window, softcap=softcap, learnable_sink=s,
                                         num_splits=num_splits, return_lse=True)
    check_dense_q(out, lse, q, pg, causal=causal, window=window, softcap=softcap, sink=s)


@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_decode_key_split_paged_page_sizes(page_size, ran_tiles):
    lens = [2 * page_size, 1000, 61, 5]
    pg = Paged(lens, page_size, 1, 128, 128, seed=page_size)
    g = torch.Generator(device="cuda").manual_seed(page_size + 1)
    q = _rand(4, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table,
                                         num_splits=0, return_lse=True)
    check_dense_q(out, lse, q, pg)
    _expect_groups(ran_tiles, 2)


@pytest.mark.parametrize("hq,hkv", [(32, 1), (32, 8)])
def test_decode_key_split_matches_the_64_row_tile(hq, hkv, monkeypatch, ran_tiles):
    """The same decode on the key-split tile and on the 64-row tile (DECODE_KEY_SPLIT off): the two sum the same
    scores in another order, so they agree to fp32 rounding before the bf16 store."""
    from flash_attn_4_sm120 import config, config_decode

    g = torch.Generator(device="cuda").manual_seed(5 + hkv)
    q = _rand(2, 1, hq, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(2, 4000, hkv, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(2, 4000, hkv, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    _expect_groups(ran_tiles, 2 if hkv == 1 else 4)
    monkeypatch.setattr(config_decode, "DECODE_KEY_SPLIT", False)
    config.clear_caches()
    ran_tiles.clear()
    out64, lse64 = fa.flash_attn_func(q, k, v, return_lse=True)
    _expect_groups(ran_tiles, 1)
    assert (out.float() - out64.float()).abs().max().item() <= 1e-2
    assert (lse - lse64).abs().max().item() <= 1e-4


# K/V pipelines deeper than two stages (kernels/fwd_cpasync.py: block n_first - i in stage i % num_stages; V of
# block n - S + 1 loads during S = QK^T of block n, K of block n - S during its softmax and PV).  Key counts give
# fewer blocks than stages (1, 17, 33 at 32 keys per block), exactly S and S + 1 blocks, and many; splits cut the
# blocks into runs of every length.
DEEP_TILES = [(32, 32, 4, 3, 2), (32, 32, 4, 4, 2), (32, 32, 4, 5, 2), (64, 32, 4, 4, 1)]


@pytest.fixture
def deep_table(monkeypatch):
    """Put one deep-pipeline tile in the d128 decode table (every row bucket) and return it."""
    from flash_attn_4_sm120 import config, config_decode

    def put(spec):
        tile = config.FwdTile(*spec[:4], kv_groups=spec[4])
        assert not config.fwd_tile_problems(128, 128, tile)
        monkeypatch.setitem(config_decode._DECODE_TILES, 128, ((tile.tile_m, tile),))
        config.clear_caches()
        return tile

    yield put
    config.clear_caches()


@pytest.mark.parametrize("spec", DEEP_TILES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sk", [1, 33, 96, 128, 160, 1023])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_deep_pipeline_contiguous(spec, sk, num_splits, deep_table, ran_tiles):
    tile = deep_table(spec)
    hq, hkv = (32, 1) if tile.tile_m == 32 else (64, 1)
    g = torch.Generator(device="cuda").manual_seed(sk + spec[3])
    lens = [sk, 0, max(sk - 17, 0)]
    q = _rand(3, 1, hq, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(3, sk, hkv, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(3, sk, hkv, 128, dtype=torch.bfloat16, gen=g)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, seqused_k=used, num_splits=num_splits, return_lse=True)
    _dense_check(out, lse, q, k, v, lens=lens)
    assert ran_tiles and all(c.tile == tile for c in ran_tiles if hasattr(c, "tile")), [c.name() for c in ran_tiles]


@pytest.mark.parametrize("spec", DEEP_TILES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", ["causal", "win_64_0", "causal_left_77"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_deep_pipeline_paged(spec, mask, page_size, deep_table, ran_tiles):
    tile = deep_table(spec)
    hq, sq = (32, 1) if tile.tile_m == 32 else (16, 4)
    window = {"causal": (None, None), "win_64_0": (64, 0), "causal_left_77": (77, None)}[mask]
    lens = [333, 17, 0, 1000]
    pg = Paged(lens, page_size, 1, 128, 128, seed=page_size + spec[3])
    g = torch.Generator(device="cuda").manual_seed(page_size * 7 + spec[3])
    q = _rand(4, sq, hq, 128, dtype=torch.bfloat16, gen=g)
    s = torch.randn(hq, device="cuda", generator=g)
    out, lse = fa.flash_attn_varlen_func(q, pg.kp, pg.vp, seqused_k=pg.seqused, page_table=pg.table, causal=True,
                                         window_size=window, softcap=20.0, learnable_sink=s, num_splits=5,
                                         return_lse=True)
    check_dense_q(out, lse, q, pg, causal=True, window=window, softcap=20.0, sink=s)
    assert ran_tiles and all(c.tile == tile for c in ran_tiles if hasattr(c, "tile")), [c.name() for c in ran_tiles]


def test_decode_full_grid_keeps_the_64_row_tile(ran_tiles):
    """A decode grid that already fills the GPU (config_decode.decode_rows) runs the 64-row tile, no key split."""
    from flash_attn_4_sm120.launch import sm_count

    b = -(-sm_count(torch.device("cuda")) // 8) + 1  # x 8 KV heads: more CTAs than SMs
    g = torch.Generator(device="cuda").manual_seed(11)
    q = _rand(b, 1, 32, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(b, 300, 8, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(b, 300, 8, 128, dtype=torch.bfloat16, gen=g)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    _dense_check(out, lse, q, k, v)
    _expect_groups(ran_tiles, 1)
    ran_tiles.clear()
    out, lse = fa.flash_attn_func(q[:2], k[:2], v[:2], return_lse=True)  # 16 CTAs: the key split
    _expect_groups(ran_tiles, 4)
