"""Block-sparse forward on a GPU against the fp32 reference with the same mask materialised (and against torch's
flex_attention on the same BlockMask).  Bar as in test_fwd_gpu.py: max |ours - ref_fp32| <= 2 * max |pytorch
same dtype - ref_fp32| + atol, LSE within 1e-3 (or -inf exactly where the reference is)."""

import math

import pytest
import torch

from reference import attention_ref, sparse_allowed
from test_fwd_gpu import _compare

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")
from flash_attn_4_sm120 import block_sparse as BS  # noqa: E402
from flash_attn_4_sm120 import config  # noqa: E402


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


def _block_size(d, dv, windowed, qr, kr):
    tile = config.select_sparse_tile(d, dv, windowed)
    return tile.tile_m * qr, tile.tile_n * kr


def _random_bst(b, h, sq, sk, block_size, density, full_frac, seed, empty_row=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nq, nk = -(-sq // block_size[0]), -(-sk // block_size[1])
    m = torch.rand(b, h, nq, nk, device="cuda", generator=g) < density
    full = m & (torch.rand(b, h, nq, nk, device="cuda", generator=g) < full_frac)
    if empty_row and nq > 1:
        m[..., 1, :] = False  # a query block with no KV block: O = 0, LSE = -inf
        full[..., 1, :] = False
    return fa.block_sparse_from_mask(m, block_size, full_mask=full if full_frac > 0 else None)


def _check(out, lse, q, k, v, bst, causal=False, window=(None, None)):
    sq, sk = q.shape[1], k.shape[1]
    visited, full = BS.dense_mask_from_block_sparse(bst, sq, sk)
    mask = sparse_allowed(visited, full, sq, sk, causal, window)
    ref, lse_ref = attention_ref(q, k, v, upcast=True, mask=mask)
    pt, _ = attention_ref(q, k, v, upcast=False, mask=mask)
    _compare(out, lse, ref, lse_ref, pt)


# (dtype, head dim, block size in tiles): every sparse tile at 1x1, wider blocks on d=128, fp16 once (the kernels
# share everything but the mma type); each entry is one compiled kernel per causal flag
CONFIGS = [(torch.bfloat16, d, (1, 1)) for d in (64, 96, 128, 192, 256)] + [
    (torch.bfloat16, 128, (2, 1)), (torch.bfloat16, 128, (1, 3)), (torch.float16, 128, (1, 1))]


@pytest.mark.parametrize("dtype,d,ratios", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(300, 517), (517, 300), (256, 256)])
def test_random_block_masks(dtype, d, ratios, causal, sq, sk):
    g = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv = 2, 4, 2  # GQA (unpacked)
    q = _rand(b, sq, hq, d, dtype=dtype, gen=g)
    k = _rand(b, sk, hkv, d, dtype=dtype, gen=g)
    v = _rand(b, sk, hkv, d, dtype=dtype, gen=g)
    bst = _random_bst(b, hq, sq, sk, _block_size(d, d, causal, *ratios), 0.5, 0.5, seed=d + sq)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, block_sparse_tensors=bst, return_lse=True)
    _check(out, lse, q, k, v, bst, causal=causal)


@pytest.mark.parametrize("kv_block", [64, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_d192_block_size_picks_the_tile(kv_block, causal):
    """d192: kv_block a multiple of 64 runs the TMA tile (128x64), an odd multiple of 32 the cp.async 128x32 tile
    (3 tiles per block); both against the reference."""
    assert config.select_sparse_tile(192, 192, causal, block_size=(128, kv_block)).tma == (kv_block == 64)
    g = torch.Generator(device="cuda").manual_seed(11)
    b, hq, hkv, sq, sk, d = 2, 4, 2, 300, 517, 192
    q = _rand(b, sq, hq, d, dtype=torch.bfloat16, gen=g)
    k = _rand(b, sk, hkv, d, dtype=torch.bfloat16, gen=g)
    v = _rand(b, sk, hkv, d, dtype=torch.bfloat16, gen=g)
    bst = _random_bst(b, hq, sq, sk, (128, kv_block), 0.5, 0.5, seed=12)
    out, lse = fa.flash_attn_func(q, k, v, causal=causal, block_sparse_tensors=bst, return_lse=True)
    _check(out, lse, q, k, v, bst, causal=causal)


@pytest.mark.parametrize("bh", [(1, 1), (1, 4), (2, 1)])
def test_broadcast_batch_and_heads(bh):
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (_rand(2, 333, 4, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bst = _random_bst(*bh, 333, 333, _block_size(128, 128, True, 1, 1), 0.6, 0.3, seed=3)
    out, lse = fa.flash_attn_func(q, k, v, causal=True, block_sparse_tensors=bst, return_lse=True)
    _check(out, lse, q, k, v, bst, causal=True)


def test_sliding_window_on_mask_blocks_and_sink_softcap():
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (_rand(1, 700, 2, 64, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bst = _random_bst(1, 2, 700, 700, _block_size(64, 64, True, 1, 1), 0.7, 0.2, seed=5)
    out, lse = fa.flash_attn_func(q, k, v, window_size=(200, 50), block_sparse_tensors=bst, return_lse=True)
    _check(out, lse, q, k, v, bst, window=(200, 50))


def test_all_blocks_full_equals_dense():
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (_rand(2, 259, 4, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bs = _block_size(128, 128, False, 1, 1)
    nq, nk = -(-259 // bs[0]), -(-259 // bs[1])
    ones = torch.ones(1, 1, nq, nk, dtype=torch.bool, device="cuda")
    for full in (None, ones):  # all mask blocks, all full blocks
        bst = fa.block_sparse_from_mask(ones, bs, full_mask=full)
        out, lse = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, return_lse=True)
        ref, lse_ref = fa.flash_attn_func(q, k, v, return_lse=True)
        assert (out.float() - ref.float()).abs().max().item() < 2e-2
        assert (lse - lse_ref).abs().max().item() < 1e-3


def test_varlen():
    g = torch.Generator(device="cuda").manual_seed(7)
    lens_q, lens_k = [300, 0, 129, 64], [200, 50, 400, 1]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hkv, d = 4, 1, 128
    q = _rand(sum(lens_q), hq, d, dtype=torch.bfloat16, gen=g)
    k = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    v = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    bs = _block_size(d, d, True, 1, 1)
    bst = _random_bst(4, hq, max(lens_q), max(lens_k), bs, 0.6, 0.3, seed=8)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                         max_seqlen_k=max(lens_k), causal=True, block_sparse_tensors=bst,
                                         return_lse=True)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if lq == 0:
            continue
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        qi, ki, vi = q[q0:q0 + lq][None], k[k0:k0 + lk][None], v[k0:k0 + lk][None]
        sub = BS.BlockSparseTensors(*(t[i:i + 1] for t in bst[:4]), bst.block_size)
        _check(out[q0:q0 + lq][None], lse[:, q0:q0 + lq][None], qi, ki, vi, sub, causal=True)


def test_lying_metadata_is_clamped_never_out_of_bounds():
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (_rand(1, 300, 2, 64, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bs = _block_size(64, 64, False, 1, 1)
    nq = -(-300 // bs[0])
    cnt = torch.full((1, 2, nq), 1 << 30, dtype=torch.int32, device="cuda")  # counts far past the width: 3
    cnt[0, 1] = -5  # head 1: no block at all
    idx = torch.zeros((1, 2, nq, 3), dtype=torch.int32, device="cuda")
    idx[..., 1] = 1 << 30  # past the end: clamped to one past the last block, which reads nothing
    idx[..., 2] = 1  # a real block
    bst = BS.BlockSparseTensors(cnt, idx, block_size=bs)
    out, lse = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, return_lse=True)
    torch.cuda.synchronize()
    _check(out, lse, q, k, v, bst)  # the reference clamps as the kernel does
    assert torch.isinf(lse[0, 1]).all() and (out[0, :, 1] == 0).all()
    # negative indices clamp to block 0 (a duplicate is visited twice: wrong numbers, but in bounds and finite)
    idx[..., 1] = -(1 << 30)
    out, lse = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(lse[0, 0]).all()


def _flex_cases():
    def causal(b, h, qi, kv):
        return qi >= kv

    def window(b, h, qi, kv):
        return (qi >= kv) & (qi - kv <= 300)

    return {"causal": (causal, dict(causal=True)), "window": (window, dict(window_size=(300, 0)))}


@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
def test_flex_block_mask_matches_flex_attention(kind):
    fx = pytest.importorskip("torch.nn.attention.flex_attention")
    s, h, d = 1000, 4, 128
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = (_rand(2, s, h, d, dtype=torch.bfloat16, gen=g) for _ in range(3))
    if kind == "documents":  # 8 documents on 128-key boundaries (no partial block: the list carries the mask)
        doc = (torch.arange(s, device="cuda") // 128).clamp(max=7)

        def mod(b, hh, qi, kv):
            return doc[qi] == doc[kv]
        kw = {}
    else:
        mod, kw = _flex_cases()[kind]
    bm = fx.create_block_mask(mod, None, None, s, s, device="cuda", BLOCK_SIZE=(128, 128))
    bst = fa.block_sparse_from_flex(bm)
    out, lse = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, return_lse=True, **kw)
    ref = fx.flex_attention(*(t.float().transpose(1, 2) for t in (q, k, v)), block_mask=bm).transpose(1, 2)
    pt = fx.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=bm).transpose(1, 2)
    atol = 1e-5 + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    err = (out.float() - ref).abs().max().item()
    err_pt = (pt.float() - ref).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{kind}: max error {err:.3e} vs flex bf16 {err_pt:.3e}"
    assert not math.isnan(err)
