"""Dropout on a GPU: the kernels' keep mask is bit-identical to ``dropout_mask`` (the pure-torch emulation), the
forward and dQ/dK/dV/dsink match the fp32 reference that uses that mask, the generator contract (manual_seed,
consecutive calls, offsets), p = 0 / p = 1, bitwise determinism, CUDA-graph capture with a seed tensor, and a
training smoke.

Bars as in test_fwd_gpu.py / test_bwd_gpu.py: max |ours - ref_fp32| <= 2 * max |pytorch_same_dtype - ref_fp32|
+ atol, with the same materialised mask in both references (a wrong mask misses by far more than that).
"""

import pytest
import torch

from reference import attention_ref, varlen_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")


def _rand(*shape, dtype, gen, grad=False):
    t = torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    return t.requires_grad_(grad)


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype=torch.bfloat16, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (_rand(b, sq, hq, d, dtype=dtype, gen=g, grad=grad), _rand(b, sk, hkv, d, dtype=dtype, gen=g, grad=grad),
            _rand(b, sk, hkv, dv, dtype=dtype, gen=g, grad=grad))


def _mask(seed, offset, p, b, h, sq, sk, batch_start=0):
    return fa.dropout_mask(seed, offset, p, b, h, sq, sk, batch_start=batch_start, device="cuda")


def _close(name, ours, ref, pt, slack=None):
    """``slack``: the part of the gradient error that FlashAttention's backward contract itself implies (see
    ``_d_slack``), added to the bound; None for the output."""
    assert ours is not None and torch.isfinite(ours).all(), f"{name}: non-finite"
    atol = 2 * (ref.float() + 0.3 - 0.3 - ref.float()).abs().max().item() + 1e-4
    if slack is not None:
        atol += torch.nan_to_num(slack.float(), nan=0.0).abs().max().item()  # rows without keys: NaN, no slack
    err = (ours.float() - ref.float()).abs().max().item()
    err_pt = (pt.float() - ref.float()).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{name}: max error {err:.3e} > 2 * {err_pt:.3e} + {atol:.1e}"


# ---- the mask itself ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk,hq,hkv,pack,d", [(300, 500, 3, 3, None, 128), (77, 131, 8, 2, True, 128),
                                                 (1, 17, 4, 1, None, 128), (129, 511, 2, 2, False, 128),
                                                 # d <= 64 non-causal: the 256-row tile, two m16 atoms per warp
                                                 (255, 500, 2, 2, False, 64), (255, 250, 4, 2, None, 32)])
# the extremes: thresholds near 0 and 2**KEEP_BITS; 0.96875 is the direct fp16 test's last threshold (0x7C00), above it
# the forward tests the complement (dropout_high_p), and 1 - 2**-17 has the threshold 2**KEEP_BITS (keeps none)
@pytest.mark.parametrize("p", [0.002, 0.1, 0.5, 0.9, 0.96875, 0.97, 0.998, 1 - 2.0 ** -17])
def test_kernel_mask_is_the_emulated_mask(sq, sk, hq, hkv, pack, d, p):
    _spell_and_compare_mask(sq, sk, hq, hkv, pack, d, p)


def _spell_and_compare_mask(sq, sk, hq, hkv, pack, d, p, **kw):
    """q = 0 gives uniform P = 1/sk; v[j] = 2**(j // d) * e_(j % d) makes out[i, c] * sk * (1 - p) the integer
    sum_b keep[i, d b + c] 2**b (< 256 for sk <= 8 d), so the output spells the kernel's mask exactly.  ``kw``: more
    arguments of the call (a window that masks nothing keeps P uniform)."""
    b = 2
    seed, offset = 0xDEADBEEF12345, 40
    q = torch.zeros(b, sq, hq, d, dtype=torch.float16, device="cuda")
    k = torch.randn(b, sk, hkv, d, dtype=torch.float16, device="cuda")
    j = torch.arange(sk, device="cuda")
    v1 = torch.zeros(sk, d, dtype=torch.float32, device="cuda")
    v1[j, j % d] = 2.0 ** (j // d).float()
    v = v1[None, :, None, :].expand(b, sk, hkv, d).to(torch.float16).contiguous()
    out = fa.flash_attn_func(q, k, v, dropout_p=p, dropout_seed=seed, dropout_offset=offset, pack_gqa=pack, **kw)[0]
    code = torch.round(out.float() * sk * (1 - p)).to(torch.int64)  # (b, sq, hq, d)
    keep = _mask(seed, offset, p, b, hq, sq, sk)  # (b, hq, sq, sk)
    want = torch.zeros(b, hq, sq, d, dtype=torch.int64, device="cuda")
    for blk in range(-(-sk // d)):
        cols = keep[..., blk * d:(blk + 1) * d].to(torch.int64) << blk
        want[..., :cols.shape[-1]] += cols
    bad = (code.permute(0, 2, 1, 3) != want).nonzero()
    assert bad.numel() == 0, (f"the kernel's keep mask differs from dropout_mask at {bad.shape[0]} (b, h, row, col) "
                              f"entries, first {bad[:8].tolist()}")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("sq,sk,hq,hkv,d", [(17, 131, 8, 2, 64), (1, 200, 4, 1, 32), (40, 300, 6, 3, 64)])
def test_packed_mask_on_the_128_key_tile(monkeypatch, sq, sk, hq, hkv, d, p):
    """Packed GQA rows with dropout on the windowed d <= 64 tile (128x128; a window wider than both sequences keeps
    P uniform): the keep mask is the contract's, and the dispatcher runs these calls packed (``dropout_packed``).
    Its keep bits of two 32-column rows once came out wrong from a loop-carried 64-bit shift register
    (benchmarks/experiments/results/packed_dropout_probe_h100_s31.log); the register is now two 32-bit halves."""
    from flash_attn_4_sm120 import plan as P

    packed = []
    real = P.get_plan

    def spy(key):
        plan = real(key)
        if plan.fwd_cfg.has_dropout:
            packed.append((plan.fwd_cfg.tile.tile_n, plan.fwd_cfg.dropout_packed))
        return plan

    monkeypatch.setattr(P, "get_plan", spy)
    _spell_and_compare_mask(sq, sk, hq, hkv, True, d, p, window_size=(4096, 4096))
    assert packed and all(tile_n == 128 for tile_n, _ in packed), packed
    assert packed[-1][1], packed  # the plan launched (the last one made) runs the packed rows


def test_high_p_runs_the_complement_forward(monkeypatch):
    """p above 0.96875 reaches the plan as ``dropout_high_p``; p at or below it does not."""
    from flash_attn_4_sm120 import plan as P

    seen = []
    real = P.get_plan

    def spy(key):
        seen.append(key.dropout_high_p)
        return real(key)

    monkeypatch.setattr(P, "get_plan", spy)
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, device="cuda")
    for p in (0.5, 0.96875, 0.97):
        fa.flash_attn_func(q, q, q, dropout_p=p, dropout_seed=1, dropout_offset=0)
    assert seen == [False, False, True], seen


def _d_slack(out, ref_out, ref_lse, ref_in, g, varlen=False):
    """The backward takes D = rowsum(dO * O) from the output as returned (rounded to bf16/fp16), as every
    FlashAttention does; the fp32 and same-dtype PyTorch references differentiate through the unrounded O.  The
    difference dD = rowsum(dO * (O_ours - O_fp32)) enters dS = P (dP - D) exactly as a gradient on the LSE does
    (dS_ij = -P_ij dD_i), so its effect on dQ/dK/dsink is the LSE's gradient with dD as the cotangent.  It matters
    where PyTorch's own error is 0: with one key (S = 1) the true dQ and dK are exactly 0 (dS = P dP - P D = 0)
    and PyTorch's same-dtype softmax backward gives exactly 0, while O = keep * v / (1 - p) is not representable
    in bf16, so the kernel's D is off by ~1e-3 relative and dQ by ~1e-2.  Without dropout O = v is exact there."""
    dd = (g.float() * (out.detach().float() - ref_out.detach().float())).sum(-1)  # (B, Sq, Hq); varlen (total, Hq)
    cot = dd.transpose(0, 1) if varlen else dd.transpose(1, 2)  # as the LSE: (B, Hq, Sq); varlen (Hq, total)
    return torch.autograd.grad(ref_lse, ref_in, torch.nan_to_num(cot, nan=0.0), retain_graph=True,
                               allow_unused=True)


# ---- forward / backward against the reference with the same mask ---------------------------------------------------
def _check(q, k, v, p, seed=123, offset=8, sink=None, grads=True, **kw):
    b, sq, hq = q.shape[:3]
    sk = k.shape[1]
    keep = _mask(seed, offset, p, b, hq, sq, sk)
    inputs = (q, k, v) + ((sink,) if sink is not None else ())
    out, lse = fa.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, dropout_p=p, dropout_seed=seed,
                                  dropout_offset=offset, **kw)
    ref_kw = {("window" if key == "window_size" else key): val for key, val in kw.items()
              if key not in ("deterministic", "pack_gqa")}

    def ref_fn(*ts, upcast):
        return attention_ref(ts[0], ts[1], ts[2], sink=ts[3] if len(ts) > 3 else None, upcast=upcast, keep=keep,
                             dropout_p=p, **ref_kw)

    ref_in = tuple(t.detach().float().requires_grad_() for t in inputs)
    pt_in = tuple(t.detach().clone().requires_grad_() for t in inputs)
    ref_out, ref_lse = ref_fn(*ref_in, upcast=True)
    pt_out, _ = ref_fn(*pt_in, upcast=False)
    _close("out", out, ref_out, pt_out)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-3 * max(1.0, ref_lse[fin].abs().max().item())
    if not grads:
        return
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, inputs, g)
    slack = _d_slack(out, ref_out, ref_lse, ref_in, g)
    ref = torch.autograd.grad(ref_out, ref_in, g.float())
    pt = torch.autograd.grad(pt_out, pt_in, g)
    for name, a, r, c, sl in zip(("dq", "dk", "dv", "dsink"), ours, ref, pt, slack):
        _close(name, a, r, c, sl)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (256, 256), (32, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (113, 113), (255, 1023)])
def test_dropout_dense(d, dv, causal, sq, sk):
    q, k, v = _inputs(2, sq, sk, 4, 2, d, dv, seed=1, grad=True)
    _check(q, k, v, 0.17, causal=causal)


@pytest.mark.parametrize("p", [0.97, 0.998, 1 - 2.0 ** -17])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_high_p_forward_and_backward(d, causal, p):
    """Thresholds above 0x7C00 (the forward's complement test) up to 2**KEEP_BITS (every element dropped: the
    backward's keep tests compare t << 16 = 2**31 as unsigned), forward and gradients against the reference."""
    q, k, v = _inputs(2, 77, 200, 4, 2, d, d, seed=4, grad=True)
    _check(q, k, v, p, causal=causal)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("hq,hkv,pack", [(8, 8, None), (8, 2, True), (8, 2, False), (7, 1, None)])
def test_dropout_gqa(p, hq, hkv, pack):
    q, k, v = _inputs(2, 333, 333, hq, hkv, 128, 128, seed=2, grad=True)
    _check(q, k, v, p, pack_gqa=pack)


@pytest.mark.parametrize("window", [(64, 0), (32, 16), (None, 48)])
def test_dropout_window(window):
    q, k, v = _inputs(2, 200, 260, 4, 4, 128, 128, seed=3, grad=True)
    _check(q, k, v, 0.2, window_size=window)


@pytest.mark.parametrize("softcap,use_sink", [(0.0, True), (15.0, False), (15.0, True)])
def test_dropout_softcap_sink(softcap, use_sink):
    q, k, v = _inputs(2, 150, 170, 4, 2, 64, 64, seed=4, grad=True)
    sink = torch.randn(4, device="cuda", requires_grad=True) if use_sink else None
    _check(q, k, v, 0.3, sink=sink, softcap=softcap, causal=True)


def test_dropout_fp16():
    q, k, v = _inputs(1, 200, 300, 4, 4, 128, 128, dtype=torch.float16, seed=5, grad=True)
    _check(q, k, v, 0.25, causal=True)


def test_dropout_varlen():
    """Positions count within each sequence and the mask's batch index is the sequence's index."""
    lens_q, lens_k = [17, 0, 130, 64], [33, 5, 130, 1]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(6)
    hq, hkv, d, p, seed, offset = 4, 2, 128, 0.3, 99, 4
    q = _rand(sum(lens_q), hq, d, dtype=torch.bfloat16, gen=g, grad=True)
    k = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g, grad=True)
    v = _rand(sum(lens_k), hkv, d, dtype=torch.bfloat16, gen=g, grad=True)

    def keep_of(bi, lq, lk):
        return _mask(seed, offset, p, 1, hq, lq, lk, batch_start=bi)

    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                         max_seqlen_k=max(lens_k), causal=True, return_lse=True, dropout_p=p,
                                         dropout_seed=seed, dropout_offset=offset)
    ref_in = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    pt_in = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, lse_ref = varlen_ref(*ref_in, cu_q, cu_k, keep_of=keep_of, causal=True, dropout_p=p)
    pt, _ = varlen_ref(*pt_in, cu_q, cu_k, keep_of=keep_of, causal=True, dropout_p=p, upcast=False)
    _close("out", out, ref, pt)
    # dO from the test's own generator: with torch.randn_like it came from the global RNG, whose state depends on
    # the tests run before in the same process; and the bound takes the slack of D = rowsum(dO * O) from the
    # rounded O (``_d_slack``) as _check does: with one key (the last sequence) PyTorch's dQ there is exactly 0
    # and the kernel's is not (a run under pytest -n 3 failed on dQ, 3.4e-2 against 2 * 1.3e-2)
    g_out = _rand(*out.shape, dtype=out.dtype, gen=g)
    ours = torch.autograd.grad(out, (q, k, v), g_out)
    slack = _d_slack(out, ref, lse_ref, ref_in, g_out, varlen=True)
    refg = torch.autograd.grad(ref, ref_in, g_out.float())
    ptg = torch.autograd.grad(pt, pt_in, g_out)
    for name, a, r, c, sl in zip(("dq", "dk", "dv"), ours, refg, ptg, slack):
        _close(name, a, r, c, sl)


# ---- generator contract ------------------------------------------------------------------------------------------
def test_generator_manual_seed_and_consecutive_calls():
    q, k, v = _inputs(1, 128, 128, 2, 2, 64, 64, seed=7)
    gen = torch.cuda.default_generators[q.device.index]
    torch.manual_seed(1234)
    seed0, off0 = gen.initial_seed(), gen.get_offset()
    a = fa.flash_attn_func(q, k, v, dropout_p=0.5)[0]
    assert gen.get_offset() == off0 + 4, "one call advances the generator's offset by 4"
    b = fa.flash_attn_func(q, k, v, dropout_p=0.5)[0]
    assert not torch.equal(a, b), "consecutive calls draw different masks"
    torch.manual_seed(1234)
    assert torch.equal(a, fa.flash_attn_func(q, k, v, dropout_p=0.5)[0]), "manual_seed reproduces the call"
    explicit = fa.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=seed0, dropout_offset=off0)[0]
    assert torch.equal(a, explicit), "the call used the generator's (seed, offset)"
    other = fa.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=seed0 + 1, dropout_offset=off0)[0]
    assert not torch.equal(a, other)


def test_seed_tensor_equals_int_seed():
    q, k, v = _inputs(2, 100, 140, 4, 2, 128, 128, seed=8, grad=True)
    seed = 0x1_0000_0001
    a = fa.flash_attn_func(q, k, v, dropout_p=0.3, dropout_seed=seed, dropout_offset=12)[0]
    st = torch.tensor([seed], dtype=torch.int64, device="cuda")
    b = fa.flash_attn_func(q, k, v, dropout_p=0.3, dropout_seed=st, dropout_offset=12)[0]
    assert torch.equal(a, b)
    g = torch.randn_like(a)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(a, (q, k, v), g),
                                                  torch.autograd.grad(b, (q, k, v), g)))


def test_p0_is_the_kernel_without_dropout_and_p1_gives_zeros():
    q, k, v = _inputs(2, 150, 190, 4, 2, 128, 128, seed=9, grad=True)
    base, lse0 = fa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    same, lse_same = fa.flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=0.0)
    assert torch.equal(base, same) and torch.equal(lse0, lse_same)
    zero, lse1 = fa.flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=1.0)
    assert torch.equal(zero, torch.zeros_like(zero)) and torch.equal(lse1, lse0), "p = 1: O = 0, LSE undropped"
    # retain_graph: the LSE's gradient below goes through the same graph (one autograd node gives zero and lse1)
    dq, dk, dv = torch.autograd.grad(zero, (q, k, v), torch.randn_like(zero), retain_graph=True)
    assert not dq.any() and not dk.any() and not dv.any()
    # through the LSE, p = 1 gives the LSE's gradient (the same as without dropout)
    g = torch.randn_like(lse1)
    ref = torch.autograd.grad(lse0, (q, k, v), g)
    got = torch.autograd.grad(lse1, (q, k, v), g)
    assert all(torch.equal(x, y) for x, y in zip(ref, got))


def test_deterministic_gradients_are_bitwise_equal():
    q, k, v = _inputs(2, 333, 333, 8, 2, 128, 128, seed=10, grad=True)
    runs = []
    for _ in range(2):
        out = fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.2, dropout_seed=5, deterministic=True)[0]
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_cuda_graph_capture():
    q, k, v = _inputs(1, 128, 256, 2, 2, 64, 64, seed=11)
    with pytest.raises(ValueError, match="CUDA graph"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fa.flash_attn_func(q, k, v, dropout_p=0.5)
    seed_t = torch.tensor([1], dtype=torch.int64, device="cuda")
    fa.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=seed_t)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=seed_t)[0]
    results = []
    for s in (1, 2, 1):
        seed_t.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        results.append(out.clone())
        assert torch.equal(out, fa.flash_attn_func(q, k, v, dropout_p=0.5, dropout_seed=s)[0])
    assert torch.equal(results[0], results[2]) and not torch.equal(results[0], results[1])


def test_torch_compile_draws_a_fresh_mask_per_call():
    q, k, v = _inputs(1, 128, 128, 2, 2, 64, 64, seed=12, grad=True)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, dropout_p=0.5)[0]

    torch.manual_seed(3)
    a = f(q, k, v)
    b = f(q, k, v)
    assert not torch.equal(a, b)
    torch.manual_seed(3)
    assert torch.equal(a, f(q, k, v))
    torch.manual_seed(3)
    eager = fa.flash_attn_func(q, k, v, dropout_p=0.5)[0]
    assert torch.equal(a, eager)
    a.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_training_smoke_with_dropout():
    torch.manual_seed(0)
    dim, heads = 128, 4
    layer = torch.nn.Linear(dim, 3 * dim, device="cuda", dtype=torch.bfloat16)
    head = torch.nn.Linear(dim, 1, device="cuda", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(list(layer.parameters()) + list(head.parameters()), lr=1e-3)
    x = torch.randn(4, 256, dim, device="cuda", dtype=torch.bfloat16)
    y = x.float().mean(-1, keepdim=True).to(torch.bfloat16)
    losses = []
    for _ in range(30):
        qkv = layer(x).view(4, 256, 3, heads, dim // heads)
        o = fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, dropout_p=0.1)[0]
        loss = torch.nn.functional.mse_loss(head(o.reshape(4, 256, dim)).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5]), losses
