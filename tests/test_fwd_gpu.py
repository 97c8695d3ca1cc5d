"""Forward correctness on a GPU against an fp32 reference.

Bar: max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol, and the LSE within 1e-3 (or both
-inf), over head dims (incl. d != dv), GQA ratios, masks, odd lengths and varlen with empty sequences.
"""

import pytest
import torch

from reference import attention_ref, varlen_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIM_PAIRS = [(32, 32), (64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128), (128, 64)]
LENGTHS = [(1, 1), (17, 113), (113, 17), (1023, 1023), (128, 4127)]


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (_rand(b, sq, hq, d, dtype=dtype, gen=g), _rand(b, sk, hkv, d, dtype=dtype, gen=g),
            _rand(b, sk, hkv, dv, dtype=dtype, gen=g))


def assert_close(out, lse, q, k, v, valid=None, **kw):
    ref, lse_ref = attention_ref(q, k, v, upcast=True, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **kw)
    _compare(out, lse, ref, lse_ref, pt, valid)


def _compare(out, lse, ref, lse_ref, pt, valid=None):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in output"
    atol = 2 * (ref.float() + 0.3 - 0.3 - ref.float()).abs().max().item() + 1e-5
    err = (out.float() - ref.float()).abs().max().item()
    err_pt = (pt.float() - ref.float()).abs().max().item()
    assert err <= 2 * err_pt + atol, f"max error {err:.3e} > 2 * {err_pt:.3e} + {atol:.1e}"
    if lse is not None:
        fin = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), fin), "LSE is finite exactly where the reference is"
        assert torch.equal(lse[~fin], lse_ref[~fin]), "LSE -inf rows"
        if fin.any():
            lerr = (lse[fin] - lse_ref[fin]).abs().max().item()
            assert lerr <= 1e-3 * max(1.0, lse_ref[fin].abs().max().item()), f"LSE error {lerr:.3e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,dv", HEAD_DIM_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_dense(dtype, d, dv, causal, sq, sk):
    if dtype == torch.float16 and (d, dv) not in [(64, 64), (128, 128), (256, 256), (192, 128)]:
        pytest.skip("fp16 runs on a subset of head dims (the kernels share everything but the mma type)")
    q, k, v = _inputs(2, sq, sk, 4, 2, d, dv, dtype)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_close(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (8, 2), (7, 1), (14, 2), (8, 1), (32, 4)])
@pytest.mark.parametrize("pack_gqa", [None, False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 4127), (17, 113), (1023, 1023)])
def test_gqa(hq, hkv, pack_gqa, causal, sq, sk):
    q, k, v = _inputs(2, sq, sk, hq, hkv, 128, 128, torch.bfloat16, seed=1)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, pack_gqa=pack_gqa, return_lse=True)
    assert_close(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("window", [(64, 0), (32, 16), (0, 0), (None, 48), (100, None), (-1, 7)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (113, 17), (1023, 1023), (333, 4127)])
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_window(window, d, sq, sk, pack_gqa):
    q, k, v = _inputs(2, sq, sk, 8, 2, d, d, torch.bfloat16, seed=2)
    out, lse = fa.flash_attn_func(q, k, v, window_size=window, pack_gqa=pack_gqa, return_lse=True)
    assert_close(out, lse, q, k, v, window=window)


@pytest.mark.parametrize("window", [(63, 63), (None, 5), (-1, -1)])
def test_causal_overrides_right_window(window):
    """transformers' sliding-window call: causal=True with window_size=(w-1, w-1) means a causal window of w."""
    q, k, v = _inputs(1, 333, 333, 4, 2, 128, 128, torch.bfloat16, seed=19)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, window_size=window, return_lse=True)
    left = window[0] if window[0] is not None and window[0] >= 0 else None
    assert_close(out, lse, q, k, v, causal=True, window=(left, None))


def test_causal_with_left_window():
    q, k, v = _inputs(1, 1023, 1023, 4, 4, 128, 128, torch.bfloat16, seed=3)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, window_size=(77, None), return_lse=True)
    assert_close(out, lse, q, k, v, causal=True, window=(77, None))


@pytest.mark.parametrize("softcap", [0.0, 5.0, 30.0])
@pytest.mark.parametrize("use_sink", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(17, 113), (113, 17), (1023, 1023)])
def test_softcap_sink(softcap, use_sink, causal, d, sq, sk):
    q, k, v = _inputs(2, sq, sk, 4, 2, d, d, torch.bfloat16, seed=4)
    q = q * 3  # larger scores so the cap matters
    sink = torch.randn(4, device="cuda") * 2 if use_sink else None
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, softcap=softcap, learnable_sink=sink, return_lse=True)
    assert_close(out, lse, q, k, v, causal=causal, softcap=softcap, sink=sink)


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_softmax_scale(scale):
    q, k, v = _inputs(1, 113, 211, 4, 4, 64, 64, torch.bfloat16, seed=5)
    out, lse = fa.flash_attn_func(q, k, v, softmax_scale=scale, return_lse=True)
    assert_close(out, lse, q, k, v, softmax_scale=scale)


def test_causal_sq_gt_sk_rows_without_keys():
    """Bottom-right causal with Sq > Sk: the first Sq - Sk rows attend to nothing -> O = 0, LSE = -inf."""
    q, k, v = _inputs(1, 300, 100, 2, 2, 128, 128, torch.bfloat16, seed=6)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[0, :200] == 0)
    assert torch.all(torch.isneginf(lse[0, :, :200]))
    assert_close(out, lse, q, k, v, causal=True)


def test_lse_none_by_default():
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, 64, torch.bfloat16)
    out, lse = fa.flash_attn_func(q, k, v)
    assert lse is None and out.shape == (1, 64, 2, 64)


def test_noncontiguous_heads_view():
    """q/k/v as views of a fused QKV projection (head stride != D), which is allowed when rows are aligned."""
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = _rand(2, 257, 3, 6, 128, dtype=torch.bfloat16, gen=g)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_close(out, lse, q, k, v, causal=True)


def _varlen_case(lens_q, lens_k, hq, hkv, d, dv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = _rand(tq, hq, d, dtype=dtype, gen=g)
    k = _rand(tk, hkv, d, dtype=dtype, gen=g)
    v = _rand(tk, hkv, dv, dtype=dtype, gen=g)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu_q, cu_k


def _varlen_compare(out, lse, q, k, v, cu_q, cu_k, used_q=None, used_k=None, **kw):
    ref, lse_ref = varlen_ref(q, k, v, cu_q, cu_k, used_q, used_k, upcast=True, **kw)
    pt, _ = varlen_ref(q, k, v, cu_q, cu_k, used_q, used_k, upcast=False, **kw)
    rows = ~torch.isnan(ref[:, 0, 0])
    _compare(out[rows], lse[:, rows], ref[rows], lse_ref[:, rows], pt[rows])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_varlen(causal, hq, hkv, d, dv):
    lens_q = [17, 0, 113, 1, 1023, 0, 64]
    lens_k = [33, 5, 113, 0, 900, 0, 200]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, hq, hkv, d, dv, torch.bfloat16, seed=8)
    out, lse = fa.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1023, max_seqlen_k=900, causal=causal,
        return_lse=True,
    )
    assert out.shape == (q.shape[0], hq, dv) and lse.shape == (hq, q.shape[0])
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, causal=causal)


@pytest.mark.parametrize("window", [(None, None), (50, 0), (20, 20)])
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_varlen_window_sink_softcap(window, pack_gqa):
    lens_q = [300, 0, 7, 129]
    lens_k = [300, 12, 0, 500]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 8, 2, 128, 128, torch.bfloat16, seed=9)
    sink = torch.randn(8, device="cuda")
    out, lse = fa.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=window, learnable_sink=sink, softcap=10.0,
        pack_gqa=pack_gqa, return_lse=True,
    )
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, window=window, sink=sink, softcap=10.0)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused(causal):
    lens_q = [200, 50, 90]
    lens_k = [300, 64, 10]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 4, 2, 128, 128, torch.bfloat16, seed=10)
    used_q = torch.tensor([150, 0, 90], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([299, 64, 0], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal,
        return_lse=True,
    )
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, used_q, used_k, causal=causal)


def test_seqused_k_with_dense_batch():
    """KV-cache style: fixed-size (B, Sk_max) cache with seqused_k, dense q."""
    q, k, v = _inputs(3, 5, 700, 8, 2, 128, 128, torch.bfloat16, seed=11)
    used_k = torch.tensor([700, 1, 333], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, seqused_k=used_k, causal=True, return_lse=True)
    for bi, n in enumerate(used_k.tolist()):
        assert_close(out[bi:bi + 1], lse[bi:bi + 1], q[bi:bi + 1], k[bi:bi + 1, :n], v[bi:bi + 1, :n], causal=True)


def test_zero_length_inputs():
    q, k, v = _inputs(2, 0, 16, 2, 2, 64, 64, torch.bfloat16)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)
    q, k, v = _inputs(2, 16, 0, 2, 2, 64, 64, torch.bfloat16)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_no_recompile_for_new_lengths():
    from flash_attn_4_sm120 import jit

    # at most four kernels per configuration: the prefill tile and the decode tiles of <= 16, <= 32 and <= 64 query
    # rows per CTA (config_decode); once those are built, no length in either regime compiles anything
    for s in (100, 1, 17, 33):
        q, k, v = _inputs(1, s, 100, 2, 2, 64, 64, torch.bfloat16)
        fa.flash_attn_func(q, k, v)
    n = len(jit._MEMORY)
    for s in (1, 16, 17, 32, 64, 65, 77, 513):
        q, k, v = _inputs(3, s, s + 5, 2, 2, 64, 64, torch.bfloat16)
        fa.flash_attn_func(q, k, v)
    assert len(jit._MEMORY) == n


def test_deterministic_forward():
    q, k, v = _inputs(2, 777, 777, 8, 2, 128, 128, torch.bfloat16, seed=12)
    a, la = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    b, lb = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(a, b) and torch.equal(la, lb)


def test_large_scores_are_stable():
    q, k, v = _inputs(1, 256, 256, 2, 2, 128, 128, torch.bfloat16, seed=13)
    out, lse = fa.flash_attn_func(q * 40, k * 40, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close(out, lse, q * 40, k * 40, v)



@pytest.fixture
def cpasync_tiles(monkeypatch):
    """Force the all-warps cp.async kernel (the fallback when the TMA kernel is not selected)."""
    from flash_attn_4_sm120 import config

    for table in (config._TILE_PREFERENCE, config._TILE_PREFERENCE_WINDOWED):
        for d, tiles in list(table.items()):
            monkeypatch.setitem(table, d, tuple(t for t in tiles if not t.tma))


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(17, 113), (1023, 1023)])
def test_cpasync_fallback_dense(cpasync_tiles, d, dv, causal, sq, sk):
    q, k, v = _inputs(2, sq, sk, 8, 2, d, dv, torch.bfloat16, seed=14)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, pack_gqa=True, return_lse=True)
    assert_close(out, lse, q, k, v, causal=causal)


def test_cpasync_fallback_varlen(cpasync_tiles):
    lens_q, lens_k = [300, 0, 7, 129], [300, 12, 0, 500]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 8, 2, 128, 128, torch.bfloat16, seed=15)
    sink = torch.randn(8, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, window_size=(40, 0),
                                         learnable_sink=sink, softcap=10.0, return_lse=True)
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, window=(40, 0), sink=sink, softcap=10.0)


@pytest.mark.parametrize("d", [64, 128, 192, 256])  # TMA kernel for d <= 192, cp.async for 256
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_unused_kv_rows_never_reaches_the_output(d, causal):
    """KV caches and padded buffers come from torch.empty: rows no sequence uses may hold NaN."""
    # dense K/V with seqused_k shorter than the rows
    q, k, v = _inputs(2, 70, 300, 4, 2, d, d, torch.bfloat16, seed=20)
    used_k = torch.tensor([77, 200], dtype=torch.int32, device="cuda")
    k2, v2 = k.clone(), v.clone()
    for bi, n in enumerate(used_k.tolist()):
        k2[bi, n:] = float("nan")
        v2[bi, n:] = float("nan")
    out, lse = fa.flash_attn_varlen_func(q, k2, v2, seqused_k=used_k, max_seqlen_k=300, causal=causal,
                                         return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for bi, n in enumerate(used_k.tolist()):
        assert_close(out[bi:bi + 1], lse[bi:bi + 1], q[bi:bi + 1], k[bi:bi + 1, :n], v[bi:bi + 1, :n], causal=causal)
    # packed K/V with NaN padding rows after cu_seqlens_k[-1]
    lens_q, lens_k = [17, 113, 64], [33, 113, 150]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 4, 2, d, d, torch.bfloat16, seed=21)
    pad = torch.full((57, 2, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    k_pad, v_pad = torch.cat([k, pad]), torch.cat([v, pad])
    out, lse = fa.flash_attn_varlen_func(q, k_pad, v_pad, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=113,
                                         max_seqlen_k=150, causal=causal, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, causal=causal)


@pytest.fixture
def lpt_on_every_grid(monkeypatch):
    """The longest-first launch order (kernels/fwd_base.py ``cta_coords``) on grids of any column count: the
    limits are read when a kernel is traced and are not part of the compile key, so this test compiles its own
    kernels (a fresh memory cache, no disk cache)."""
    from flash_attn_4_sm120 import config, jit

    monkeypatch.setattr(config, "FWD_LPT_MIN_COLUMNS", 1)
    monkeypatch.setattr(config, "FWD_LPT_MAX_COLUMNS", 1 << 30)
    monkeypatch.setattr(jit, "_MEMORY", {})
    monkeypatch.setenv("FA4_SM120_DISK_CACHE", "0")
    config.clear_caches()
    yield
    config.clear_caches()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "window"])
def test_lpt_order_dense_and_varlen(d, mask, lpt_on_every_grid):
    """Every (tile column, head group, batch) runs exactly once in the dealt order: dense with packed GQA, and
    varlen with empty sequences (varlen q adds the grid's extra column, which must still launch once)."""
    kw = dict(causal=True) if mask == "causal" else dict(window_size=(100, 30))
    ref_kw = dict(causal=True) if mask == "causal" else dict(window=(100, 30))
    q, k, v = _inputs(3, 700, 777, 8, 2, d, d, torch.bfloat16, seed=d)
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True, **kw)
    assert_close(out, lse, q, k, v, **ref_kw)
    lens_q = [300, 0, 1, 513, 77]
    lens_k = [300, 9, 40, 600, 0]
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 6, 3, d, d, torch.bfloat16, seed=d + 1)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=513,
                                         max_seqlen_k=600, return_lse=True, **kw)
    _varlen_compare(out, lse, q, k, v, cu_q, cu_k, **ref_kw)


def test_lpt_order_at_its_own_column_count():
    """The shipped limits: a causal grid of 32 tile columns (S = 4096 on the d64 128-row tile) deals its CTAs."""
    from flash_attn_4_sm120 import config

    q, k, v = _inputs(1, 4096, 4096, 2, 2, 64, 64, torch.bfloat16, seed=3)
    columns = -(-4096 // config.select_fwd_tile(64, 64, True).tile_m)
    assert config.FWD_LPT_MIN_COLUMNS <= columns <= config.FWD_LPT_MAX_COLUMNS
    out, lse = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_close(out, lse, q, k, v, causal=True)
