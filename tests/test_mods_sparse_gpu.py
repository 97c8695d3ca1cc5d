"""Score/mask mods together with block sparsity, on a GPU: the mask_mod runs on "mask" blocks only ("full" blocks
skip it, as upstream's do), a score_mod on every listed block; forward and gradients against the fp32 reference
with the same element mask materialised, and the two patterns flex users write: causal as a block mask plus a
causal mask_mod (against ``causal=True``) and document masking as a block mask plus the document mask_mod
(against the varlen call on the same documents).

Bar: max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32| + atol (as test_mods_gpu.py).
"""

import pytest
import torch

from reference import attention_ref, sparse_allowed

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


def _mods():
    from flash_attn_4_sm120 import mods

    return mods


def _rand(*shape, gen=None, grad=False):
    t = torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(torch.bfloat16)
    return t.requires_grad_(grad)


def _tol(name, ours, ref, pt, atol=1e-3):
    assert ours is not None and torch.isfinite(ours).all(), f"{name}: non-finite values"
    err = (ours.float() - ref.float()).abs().max().item()
    err_pt = (pt.float() - ref.float()).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {atol:.1e}"


def _check(q, k, v, mods, aux, mask, bias, bst, grads=True):
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True, aux_tensors=aux or None, block_sparse_tensors=bst,
                                  **mods)
    ref_o, ref_lse = attention_ref(*(t.detach() for t in (q, k, v)), mask=mask, bias=bias)
    pt_o, _ = attention_ref(*(t.detach() for t in (q, k, v)), mask=mask, bias=bias, upcast=False)
    _tol("out", out, ref_o, pt_o)
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), "rows with no keys differ (LSE -inf)"
    torch.testing.assert_close(lse[live], ref_lse[live], atol=2e-2, rtol=0)
    if not grads:
        return out, lse
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    ref_in = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    pt_in = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_ref(*ref_in, mask=mask, bias=bias)[0], ref_in, g.float())
    pt = torch.autograd.grad(attention_ref(*pt_in, mask=mask, bias=bias, upcast=False)[0], pt_in, g)
    for name, a, b_, c in zip(("dq", "dk", "dv"), ours, ref, pt):
        _tol(name, a, b_, c)
    return out, lse


def _causal_blocks(s, bs=128):
    n = -(-s // bs)
    qb = torch.arange(n, device="cuda")[:, None]
    kb = torch.arange(n, device="cuda")[None, :]
    return (qb == kb)[None, None], (kb < qb)[None, None]  # mask blocks (diagonal), full blocks (below)


@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("s", [300, 1024])
def test_causal_as_block_mask_plus_mask_mod(d, s):
    """The flex pattern for causal attention: diagonal blocks listed as "mask" blocks with a causal mask_mod, the
    blocks below as "full" ones; the same result as causal=True."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (_rand(2, s, 4, d, gen=gen, grad=True) for _ in range(3))
    diag, below = _causal_blocks(s)
    bst = fa.block_sparse_from_mask(diag, (128, 128), full_mask=below)
    i = torch.arange(s, device="cuda")[:, None]
    j = torch.arange(s, device="cuda")[None, :]
    out, lse = _check(q, k, v, _mods().causal(), [], (j <= i)[None, None], None, bst)
    with torch.no_grad():
        out_c, lse_c = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out.float(), out_c.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse_c, atol=1e-3, rtol=0)


def _doc_blocks(offsets, n, bs=128):
    """(mask blocks, full blocks) of document masking over one packed sequence of ``n`` tokens: a block pair is
    listed when some document has tokens in both, "full" when both blocks lie inside one document."""
    nb = -(-n // bs)
    starts = torch.arange(nb, device="cuda") * bs
    ends = torch.clamp(starts + bs, max=n)
    ids = _mods().document_ids(offsets, n)
    first, last = ids[starts], ids[ends - 1]
    visited = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    full = (first[:, None] == last[:, None]) & (first[None, :] == last[None, :]) & (first[:, None] == first[None, :])
    return (visited & ~full)[None, None], full[None, None], ids


@pytest.mark.parametrize("d", [64, 128])
def test_document_mask_as_block_mask_matches_varlen(d):
    """Document masking over packed documents (one of length 0, one of length 1, block-straddling ones) as a
    block mask plus the document mask_mod: the reference, and the varlen call on the same documents."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    lens = [300, 1, 0, 517, 128, 200]
    n = sum(lens)
    offsets = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (_rand(1, n, 4, d, gen=gen, grad=True) for _ in range(3))
    mask_b, full_b, ids = _doc_blocks(offsets, n)
    bst = fa.block_sparse_from_mask(mask_b, (128, 128), full_mask=full_b)
    keep = (ids[:, None] == ids[None, :])[None, None]
    out, lse = _check(q, k, v, _mods().document(), [ids], keep, None, bst)
    with torch.no_grad():
        out_v, lse_v = fa.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                                                 max_seqlen_q=max(lens), max_seqlen_k=max(lens), return_lse=True)
    torch.testing.assert_close(out[0].float(), out_v.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[0], lse_v, atol=1e-3, rtol=0)


@pytest.mark.parametrize("d", [64, 128])
def test_causal_document_mask_grads(d):
    """causal=True over a document block mask with the document mask_mod, gradients included: at d128 this call
    runs the 64x64 dK/dV tile (an aux-reading mask_mod with a window), so its lists must be prepared for that tile,
    not for the key-row 32x128 one (block_sparse._bwd_tiles; tests/test_block_sparse_bwd.py checks every flag
    subset on the CPU)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens = [300, 1, 0, 517, 128, 200]
    n = sum(lens)
    offsets = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (_rand(1, n, 4, d, gen=gen, grad=True) for _ in range(3))
    mask_b, full_b, ids = _doc_blocks(offsets, n)
    nb = mask_b.shape[-1]
    below = torch.arange(nb, device="cuda")[None, :] <= torch.arange(nb, device="cuda")[:, None]
    bst = fa.block_sparse_from_mask((mask_b | full_b) & below, (128, 128))  # every visited block a mask block
    i = torch.arange(n, device="cuda")[:, None]
    j = torch.arange(n, device="cuda")[None, :]
    keep = ((ids[:, None] == ids[None, :]) & (j <= i))[None, None]
    _check(q, k, v, {**_mods().document(), "causal": True}, [ids], keep, None, bst)


def test_full_blocks_skip_the_mask_mod():
    """A mask_mod that masks a whole key range: on blocks listed as "full" it does not run (they stay visible), on
    blocks listed as "mask" it does."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    s, d = 512, 64
    q, k, v = (_rand(1, s, 2, d, gen=gen, grad=True) for _ in range(3))
    mods = _mods().prefix_lm(0)  # keeps keys j <= i only: masks the upper triangle
    nb = s // 128
    every = torch.ones(1, 1, nb, nb, dtype=torch.bool, device="cuda")
    none = torch.zeros_like(every)
    # every block full: the mask_mod never runs -> plain attention
    bst = fa.block_sparse_from_mask(none, (128, 128), full_mask=every)
    _check(q, k, v, mods, [], None, None, bst)
    # every block a mask block: the mask_mod runs everywhere -> causal
    i = torch.arange(s, device="cuda")[:, None]
    j = torch.arange(s, device="cuda")[None, :]
    bst = fa.block_sparse_from_mask(every, (128, 128))
    _check(q, k, v, mods, [], (j <= i)[None, None], None, bst)


@pytest.mark.parametrize("name", ["alibi", "relative_bias"])
def test_score_mod_on_random_block_masks(name):
    """A score_mod runs on every listed block (mask and full), with its backward."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, s, h, d = 2, 700, 4, 128
    q, k, v = (_rand(b, s, h, d, gen=gen, grad=True) for _ in range(3))
    nb = -(-s // 128)
    m = torch.rand(b, h, nb, nb, device="cuda", generator=gen) < 0.5
    full = m & (torch.rand(b, h, nb, nb, device="cuda", generator=gen) < 0.5)
    bst = fa.block_sparse_from_mask(m, (128, 128), full_mask=full)
    visited, fullm = fa.block_sparse.dense_mask_from_block_sparse(bst, s, s)
    mask = sparse_allowed(visited, fullm, s, s)
    m_ = _mods()
    i = torch.arange(s, device="cuda")[:, None]
    j = torch.arange(s, device="cuda")[None, :]
    if name == "alibi":
        slopes = torch.exp2(-8.0 * (torch.arange(h, device="cuda") + 1) / h).float()
        mods, aux, bias = m_.alibi(), [slopes], (-slopes[:, None, None] * (i - j).abs().float()[None])[None]
    else:
        table = torch.randn(h, 9, device="cuda", generator=gen)
        mods, aux, bias = m_.relative_bias(4), [table], table[:, ((j - i).clamp(-4, 4) + 4)][None]
    _check(q, k, v, mods, aux, mask, bias, bst)


def test_mask_mod_with_sparsity_at_d256_needs_no_grad():
    """d = 256: the dK/dV tile spills with a mask_mod under block sparsity (config_bwd._BWD_SPILLING), so a call that
    needs grad raises before launch; without grad it runs."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    s = 256
    q, k, v = (_rand(1, s, 2, 256, gen=gen, grad=True) for _ in range(3))
    diag, below = _causal_blocks(s)
    bst = fa.block_sparse_from_mask(diag, (128, 128), full_mask=below)
    with pytest.raises(ValueError, match="head_dim=256"):
        fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, **_mods().causal())
    i = torch.arange(s, device="cuda")[:, None]
    j = torch.arange(s, device="cuda")[None, :]
    with torch.no_grad():
        _check(q.detach(), k.detach(), v.detach(), _mods().causal(), [], (j <= i)[None, None], None, bst,
               grads=False)
