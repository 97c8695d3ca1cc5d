"""Block-sparse backward on a GPU: gradients against fp32 autograd through the reference with the same mask
materialised (and against torch's flex_attention on the same BlockMask).

Bar per gradient as test_bwd_gpu.py: max |ours - ref_fp32| <= 2 * max |pytorch same dtype - ref_fp32| + atol.
Forward outputs are checked as in test_block_sparse_gpu.py.  Query blocks with no KV block (O = 0, LSE = -inf)
must get dQ = 0, KV blocks no query block lists must get dK = dV = 0.
"""

import pytest
import torch

from reference import attention_ref, sparse_allowed
from test_bwd_gpu import _tol_check
from test_fwd_gpu import _compare
from test_sync_gpu import assert_no_sync, spin_cycles  # noqa: F401,F811 - spin_cycles is a fixture

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

fa = pytest.importorskip("flash_attn_4_sm120")
from flash_attn_4_sm120 import block_sparse as BS  # noqa: E402


def _rand(*shape, dtype, gen, grad=True):
    t = torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    return t.requires_grad_(grad)


def _block_size(d, windowed, qr=1, kr=1):
    """A block size a call that needs grad accepts (multiples of the forward, dQ and dK/dV tiles)."""
    q, k = BS.grad_block_multiples(d, d, windowed)["auto"]
    return q * qr, k * kr


def _random_masks(b, h, sq, sk, block_size, density, full_frac, seed, empty_row=True, empty_col=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nq, nk = -(-sq // block_size[0]), -(-sk // block_size[1])
    m = torch.rand(b, h, nq, nk, device="cuda", generator=g) < density
    full = m & (torch.rand(b, h, nq, nk, device="cuda", generator=g) < full_frac)
    if empty_row and nq > 1:
        m[..., 1, :] = False  # a query block with no KV block: O = 0, LSE = -inf, dQ = 0
        full[..., 1, :] = False
    if empty_col and nk > 1:
        m[..., :, nk - 1] = False  # a KV block no query block lists: dK = dV = 0
        full[..., :, nk - 1] = False
    return m, full


def _random_bst(b, h, sq, sk, block_size, density=0.5, full_frac=0.5, seed=0, **kw):
    m, full = _random_masks(b, h, sq, sk, block_size, density, full_frac, seed, **kw)
    return fa.block_sparse_from_mask(m, block_size, full_mask=full if full_frac > 0 else None)


def _run(fn, inputs, g):
    out, lse = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, g)
    return out, lse, grads


def _check(q, k, v, bst, causal=False, window=(None, None), bst_bwd=None, softcap=0.0, seed=0):
    """Forward and gradients of a block-sparse call against the references; returns (out, lse, grads)."""
    sq, sk = q.shape[1], k.shape[1]
    kw = dict(causal=causal, softcap=softcap)
    if window != (None, None):
        kw["window_size"] = window
    g = torch.randn(*q.shape[:-1], v.shape[-1], device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(seed)).to(q.dtype)
    out, lse, ours = _run(lambda *t: fa.flash_attn_func(*t, block_sparse_tensors=bst, block_sparse_tensors_bwd=bst_bwd,
                                                        return_lse=True, **kw), (q, k, v), g)
    visited, full = BS.dense_mask_from_block_sparse(bst, sq, sk)
    mask = sparse_allowed(visited, full, sq, sk, causal, window)

    def ref_fn(*ts, upcast):
        return attention_ref(*ts, upcast=upcast, mask=mask, softcap=softcap)

    ref_in = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    pt_in = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse, ref = _run(lambda *t: ref_fn(*t, upcast=True), ref_in, g.float())
    pt_out, _, pt = _run(lambda *t: ref_fn(*t, upcast=False), pt_in, g)
    _compare(out, lse, ref_out.to(q.dtype), ref_lse, pt_out)
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, ref, pt):
        _tol_check(name, a, b, c)
    # exact zeros where nothing attends: query rows that see no key, keys no query sees (per KV head: summed over
    # its query heads)
    rows_empty = ~mask.expand(q.shape[0], q.shape[2], sq, sk).any(-1)  # (B, Hq, Sq)
    assert (ours[0].transpose(1, 2)[rows_empty] == 0).all(), "dQ of rows that see no key must be 0"
    hkv = k.shape[2]
    seen = mask.expand(q.shape[0], q.shape[2], sq, sk).any(-2)  # (B, Hq, Sk)
    seen = seen.reshape(q.shape[0], hkv, q.shape[2] // hkv, sk).any(2)  # (B, Hkv, Sk)
    for name, gr in (("dK", ours[1]), ("dV", ours[2])):
        assert (gr.transpose(1, 2)[~seen] == 0).all(), f"{name} of keys no query sees must be 0"
    return out, lse, ours


# (head dim, block size in tiles of the grad multiples): every backward tile, wider blocks on d=128
CONFIGS = [(d, (1, 1)) for d in (64, 128, 192, 256)] + [(128, (2, 1)), (128, (1, 2))]


# each entry compiles three kernels (forward, dK/dV, dQ) per causal flag: Sq > Sk on one configuration only
CASES = [(d, r, c, 300, 517) for d, r in CONFIGS for c in (False, True)] + [(128, (1, 1), True, 517, 300),
                                                                           (128, (1, 1), False, 517, 300)]


@pytest.mark.parametrize("d,ratios,causal,sq,sk", CASES)
def test_random_block_masks_grads(d, ratios, causal, sq, sk):
    g = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv = 2, 4, 2  # GQA (unpacked)
    q = _rand(b, sq, hq, d, dtype=torch.bfloat16, gen=g)
    k = _rand(b, sk, hkv, d, dtype=torch.bfloat16, gen=g)
    v = _rand(b, sk, hkv, d, dtype=torch.bfloat16, gen=g)
    bst = _random_bst(b, hq, sq, sk, _block_size(d, causal, *ratios), 0.5, 0.5, seed=d + sq)
    out, lse, _ = _check(q, k, v, bst, causal=causal)
    nq_block = bst.block_size[0]
    if sq > nq_block:  # the empty query block row: O = 0, LSE = -inf
        rows = slice(nq_block, min(2 * nq_block, sq))
        assert (out[:, rows] == 0).all() and torch.isinf(lse[:, :, rows]).all()


@pytest.mark.parametrize("bh", [(1, 1), (1, 4), (2, 1)])
def test_broadcast_batch_and_heads(bh):
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (_rand(2, 333, 4, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bst = _random_bst(*bh, 333, 333, _block_size(128, True), 0.6, 0.3, seed=3)
    _check(q, k, v, bst, causal=True)


@pytest.mark.parametrize("hq,hkv", [(8, 1), (6, 2), (4, 4)])
def test_gqa(hq, hkv):
    g = torch.Generator(device="cuda").manual_seed(11)
    q = _rand(1, 400, hq, 64, dtype=torch.bfloat16, gen=g)
    k = _rand(1, 400, hkv, 64, dtype=torch.bfloat16, gen=g)
    v = _rand(1, 400, hkv, 64, dtype=torch.bfloat16, gen=g)
    bst = _random_bst(1, hq, 400, 400, _block_size(64, False), 0.5, 0.4, seed=12)  # a list per query head
    _check(q, k, v, bst)


def test_sliding_window_on_mask_blocks_softcap_fp16():
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (_rand(1, 700, 2, 64, dtype=torch.float16, gen=g) for _ in range(3))
    bst = _random_bst(1, 2, 700, 700, _block_size(64, True), 0.7, 0.3, seed=5)
    _check(q, k, v, bst, window=(200, 50), softcap=30.0)


def test_given_bwd_lists_equal_auto_built_bitwise():
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (_rand(2, 600, 4, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bs = _block_size(128, True)
    bst = _random_bst(2, 4, 600, 600, bs, 0.5, 0.5, seed=7)
    nk = -(-600 // bs[1])
    given = fa.BlockSparseTensors(*BS.transpose_block_sparse(tuple(bst[:4]), nk), bs)
    gr = torch.randn(2, 600, 4, 128, device="cuda", generator=g).to(torch.bfloat16)
    runs = []
    for bwd in (None, given):
        out, _, grads = _run(lambda *t: fa.flash_attn_func(*t, causal=True, block_sparse_tensors=bst,
                                                           block_sparse_tensors_bwd=bwd, return_lse=True),
                             (q, k, v), gr)
        runs.append((out, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    _check(q, k, v, bst, causal=True, bst_bwd=given)


def test_given_bwd_lists_with_a_finer_block_size():
    """The KV-major lists may use their own block size (a multiple of the dK/dV tile): the (128, 128) forward
    blocks written as blocks of the dK/dV tile."""
    from flash_attn_4_sm120 import config_bwd

    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (_rand(1, 512, 2, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    m, full = _random_masks(1, 2, 512, 512, (128, 128), 0.5, 0.5, seed=9)
    bst = fa.block_sparse_from_mask(m, (128, 128), full_mask=full)
    tile = config_bwd.select_bwd_config("bf16", 128, 128)
    tm, tn = tile.tile_m, tile.tile_n
    assert (tm, tn) != (128, 128)  # a finer block size than the forward's
    up = lambda x: x.repeat_interleave(128 // tm, 2).repeat_interleave(128 // tn, 3)  # noqa: E731
    fine = fa.block_sparse_from_mask(up(m).transpose(-1, -2).contiguous(), (tm, tn),
                                     full_mask=up(full).transpose(-1, -2).contiguous())
    _check(q, k, v, bst, bst_bwd=fine)


def test_deterministic_bitwise():
    g = torch.Generator(device="cuda").manual_seed(10)
    q = _rand(2, 777, 8, 128, dtype=torch.bfloat16, gen=g)
    k = _rand(2, 777, 2, 128, dtype=torch.bfloat16, gen=g)
    v = _rand(2, 777, 2, 128, dtype=torch.bfloat16, gen=g)
    bst = _random_bst(2, 8, 777, 777, _block_size(128, True), 0.5, 0.5, seed=11)
    gr = torch.randn(2, 777, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    runs = []
    for _ in range(3):
        _, _, grads = _run(lambda *t: fa.flash_attn_func(*t, causal=True, block_sparse_tensors=bst,
                                                         deterministic=True, return_lse=True), (q, k, v), gr)
        runs.append(grads)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_varlen_grads():
    g = torch.Generator(device="cuda").manual_seed(12)
    lens_q, lens_k = [300, 0, 129, 64], [200, 50, 400, 1]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hkv, d = 4, 2, 128
    q = _rand(sum(lens_q), hq, d, dtype=torch.bfloat16, gen=g)
    k = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    v = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g)
    bs = _block_size(d, True)
    bst = _random_bst(4, hq, max(lens_q), max(lens_k), bs, 0.6, 0.3, seed=13, empty_col=False)
    gr = torch.randn(sum(lens_q), hq, d, device="cuda", generator=g).to(torch.bfloat16)
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                         max_seqlen_k=max(lens_k), causal=True, block_sparse_tensors=bst,
                                         return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), gr)
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        q0, k0 = int(cu_q[i]), int(cu_k[i])
        if lq == 0:
            assert (dk[k0:k0 + lk] == 0).all() and (dv[k0:k0 + lk] == 0).all()
            continue
        sub = BS.BlockSparseTensors(*(t[i:i + 1] for t in bst[:4]), bst.block_size)
        qi, ki, vi = (t.detach()[None].requires_grad_() for t in (q[q0:q0 + lq], k[k0:k0 + lk], v[k0:k0 + lk]))
        visited, full = BS.dense_mask_from_block_sparse(sub, lq, lk)
        mask = sparse_allowed(visited, full, lq, lk, True)
        gi = gr[q0:q0 + lq][None]
        ref_in = tuple(t.detach().float().requires_grad_() for t in (qi, ki, vi))
        pt_in = tuple(t.detach().clone().requires_grad_() for t in (qi, ki, vi))
        _, _, ref = _run(lambda *t: attention_ref(*t, mask=mask), ref_in, gi.float())
        _, _, pt = _run(lambda *t: attention_ref(*t, upcast=False, mask=mask), pt_in, gi)
        for name, a, b, c in zip(("dq", "dk", "dv"), (dq[q0:q0 + lq][None], dk[k0:k0 + lk][None],
                                                        dv[k0:k0 + lk][None]), ref, pt):
            _tol_check(f"seq {i} {name}", a, b, c)


def test_lying_metadata_is_clamped_never_out_of_bounds():
    g = torch.Generator(device="cuda").manual_seed(14)
    q, k, v = (_rand(1, 300, 2, 64, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bs = _block_size(64, False)
    nq, nk = -(-300 // bs[0]), -(-300 // bs[1])
    cnt = torch.full((1, 2, nq), 1 << 30, dtype=torch.int32, device="cuda")
    cnt[0, 1] = -5
    idx = torch.zeros((1, 2, nq, 3), dtype=torch.int32, device="cuda")
    idx[..., 1] = 1 << 30
    idx[..., 2] = -(1 << 30)
    bst = BS.BlockSparseTensors(cnt, idx, block_size=bs)
    # lying KV-major lists too (given): counts past the width, indices far outside
    bcnt = torch.full((1, 2, nk), 1 << 30, dtype=torch.int32, device="cuda")
    bidx = torch.full((1, 2, nk, 2), 1 << 30, dtype=torch.int32, device="cuda")
    bidx[..., 0] = -7
    for bwd in (None, BS.BlockSparseTensors(bcnt, bidx, block_size=bs)):
        out, _ = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, block_sparse_tensors_bwd=bwd,
                                    return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        torch.cuda.synchronize()
        for t in grads:
            assert torch.isfinite(t).all()
        assert (grads[0][0, :, 1] == 0).all()  # head 1 lists nothing in the forward: dQ = 0


def test_backward_builds_the_transpose_without_a_host_sync(spin_cycles):  # noqa: F811
    """The auto-built KV-major lists come from torch ops of fixed shapes: behind a queued spin kernel, the
    forward and backward of a block-sparse call must return (launches queued) before the spin ends
    (test_sync_gpu.py's method)."""
    g = torch.Generator(device="cuda").manual_seed(15)
    q, k, v = (_rand(1, 1024, 4, 128, dtype=torch.bfloat16, gen=g) for _ in range(3))
    bst = _random_bst(1, 4, 1024, 1024, _block_size(128, False), 0.3, 0.3, seed=16)
    gr = torch.randn(1, 1024, 4, 128, device="cuda", generator=g).to(torch.bfloat16)

    def call():
        out, _ = fa.flash_attn_func(q, k, v, block_sparse_tensors=bst, return_lse=True)
        return torch.autograd.grad(out, (q, k, v), gr)

    assert_no_sync(call, spin_cycles, "block-sparse forward + backward (auto-built KV-major lists)")


@pytest.mark.parametrize("kind", ["causal", "window", "documents"])
@pytest.mark.parametrize("given_bwd", [False, True])
def test_flex_block_mask_grads_match_flex_attention(kind, given_bwd):
    fx = pytest.importorskip("torch.nn.attention.flex_attention")
    s, h, d = 1000, 4, 128
    g = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = (_rand(2, s, h, d, dtype=torch.bfloat16, gen=g) for _ in range(3))
    kw = {}
    if kind == "documents":  # 8 documents on 128-key boundaries (no partial block: the lists carry the mask)
        doc = (torch.arange(s, device="cuda") // 128).clamp(max=7)

        def mod(b, hh, qi, kv):
            return doc[qi] == doc[kv]
    elif kind == "causal":
        def mod(b, hh, qi, kv):
            return qi >= kv
        kw = dict(causal=True)
    else:
        def mod(b, hh, qi, kv):
            return (qi >= kv) & (qi - kv <= 300)
        kw = dict(window_size=(300, 0))
    bm = fx.create_block_mask(mod, None, None, s, s, device="cuda", BLOCK_SIZE=(128, 128))
    bst = fa.block_sparse_from_flex(bm)
    bwd = fa.block_sparse_bwd_from_flex(bm) if given_bwd else None
    gr = torch.randn(2, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    _, _, ours = _run(lambda *t: fa.flash_attn_func(*t, block_sparse_tensors=bst, block_sparse_tensors_bwd=bwd,
                                                    return_lse=True, **kw), (q, k, v), gr)

    def flex(*ts):
        o = fx.flex_attention(*(t.transpose(1, 2) for t in ts), block_mask=bm).transpose(1, 2)
        return o, None

    ref_in = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    pt_in = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    _, _, ref = _run(flex, ref_in, gr.float())
    _, _, pt = _run(flex, pt_in, gr)
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, ref, pt):
        _tol_check(f"{kind} {name}", a, b, c)


def test_transposed_lists_memo_reuses_only_unmodified_lists():
    """The KV-major lists built for a backward are reused for the same, unmodified list tensors, and rebuilt when a
    list is written in place (its version counter moves) or for other tensors with equal values."""
    g = torch.Generator(device="cuda").manual_seed(3)
    bst = BS.block_sparse_from_mask(torch.rand(2, 3, 4, 5, device="cuda", generator=g) < 0.5, (128, 128))
    dev = bst.mask_block_cnt.device
    tensors = BS._check_tensors(bst, batch=2, heads=3, num_rows=4, device=dev, rows="q", arg="block_sparse_tensors")
    first = BS._transposed_memo(tensors, 5)
    assert BS._transposed_memo(tensors, 5) is first
    again = BS._check_tensors(bst, batch=2, heads=3, num_rows=4, device=dev, rows="q", arg="block_sparse_tensors")
    assert BS._transposed_memo(again, 5) is first  # the same objects (the no-full-block pair is shared)
    copies = tuple(t.clone() for t in tensors)
    fresh = BS._transposed_memo(copies, 5)
    assert fresh is not first and all(torch.equal(a, b) for a, b in zip(fresh, first))
    bst.mask_block_cnt.zero_()  # in place: the version counter moves
    rebuilt = BS._transposed_memo(tensors, 5)
    assert rebuilt is not first
    assert torch.equal(rebuilt[0], torch.zeros_like(rebuilt[0]))
    for a, b in zip(rebuilt, BS.transpose_block_sparse(tensors, 5)):
        assert torch.equal(a, b)
