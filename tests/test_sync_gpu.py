"""No device->host synchronisation in a call that gets what FlashAttention asks for.

Method: queue a long spin kernel (torch.cuda._sleep, ~300 ms, calibrated with CUDA events), then call; a call that
syncs (``.item()``, ``.tolist()``, ``.cpu()``, a blocking copy, ``synchronize``) cannot return before the spin ends.
The call must return while the spin is still running (its end event not reached) and in less than half the spin.
Every configuration is called twice first (compile, first-call caches), so only the steady state is measured.

Covered: dense forward (plain; GQA/causal/window/softcap/sink/return_lse), varlen forward with max_seqlen_q/k given
(with and without seqused), the backward of a dense and of a varlen call (torch.autograd.grad), and the automatic
pack_gqa choice (pack_gqa=None).  Varlen without max_seqlen_* may sync once (documented); it only has to work.
"""

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

fa = pytest.importorskip("flash_attn_4_sm120")

SPIN_MS = 300.0
DT = torch.bfloat16


@pytest.fixture(scope="module")
def spin_cycles():
    """torch.cuda._sleep cycles that take about SPIN_MS on this GPU."""
    torch.cuda.synchronize()
    probe = 20_000_000
    torch.cuda._sleep(1000)  # load the kernel
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b)
    assert ms > 0, "torch.cuda._sleep did not take measurable time"
    return int(probe * SPIN_MS / ms)


def assert_no_sync(fn, cycles, what, warmup=2):
    """Call ``fn`` behind a queued spin kernel; it must return while the spin is still running."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, spin_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    spin_end.record()
    t0 = time.perf_counter()
    result = fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    spin_still_running = not spin_end.query()
    torch.cuda.synchronize()
    spin_ms = start.elapsed_time(spin_end)
    assert spin_ms > 50, f"spin kernel too short to tell ({spin_ms:.1f} ms)"
    assert spin_still_running and host_ms < 0.5 * spin_ms, (
        f"{what}: the call waited for the GPU (host {host_ms:.1f} ms, spin {spin_ms:.1f} ms, "
        f"spin still running when the call returned: {spin_still_running})"
    )
    return result


def _rand(*shape, gen, grad=False):
    t = torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen).to(DT)
    return t.requires_grad_(grad)


def _dense(b, sq, sk, hq, hkv, d=128, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return _rand(b, sq, hq, d, gen=g, grad=grad), _rand(b, sk, hkv, d, gen=g, grad=grad), \
        _rand(b, sk, hkv, d, gen=g, grad=grad)


LENS_Q = [17, 0, 113, 64]
LENS_K = [33, 5, 113, 200]


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _varlen(hq, hkv, d=128, seed=1, grad=False, lens_q=LENS_Q, lens_k=LENS_K):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _rand(sum(lens_q), hq, d, gen=g, grad=grad)
    k = _rand(sum(lens_k), hkv, d, gen=g, grad=grad)
    v = _rand(sum(lens_k), hkv, d, gen=g, grad=grad)
    return q, k, v, _cu(lens_q), _cu(lens_k)


# ---------------------------------------------------------------- dense forward

def test_dense_fwd_no_sync(spin_cycles):
    q, k, v = _dense(2, 256, 256, 4, 4)
    out = assert_no_sync(lambda: fa.flash_attn_func(q, k, v), spin_cycles, "dense forward")
    assert out[0].shape == q.shape and out[1] is None


DENSE_OPTIONS = {
    "gqa_causal": dict(causal=True),
    "window": dict(window_size=(64, 16)),
    "softcap": dict(softcap=10.0),
    "sink": dict(learnable_sink="sink"),
    "return_lse": dict(return_lse=True, causal=True),
    "all": dict(causal=True, window_size=(48, None), softcap=10.0, learnable_sink="sink", return_lse=True),
}


@pytest.mark.parametrize("name", list(DENSE_OPTIONS))
def test_dense_fwd_options_no_sync(spin_cycles, name):
    q, k, v = _dense(2, 200, 300, 8, 2, seed=2)
    kw = dict(DENSE_OPTIONS[name])
    if kw.get("learnable_sink") == "sink":
        kw["learnable_sink"] = torch.randn(8, device="cuda")
    out, lse = assert_no_sync(lambda: fa.flash_attn_func(q, k, v, **kw), spin_cycles, f"dense forward ({name})")
    assert out.shape == q.shape
    assert (lse is not None) == bool(kw.get("return_lse"))


@pytest.mark.parametrize("sq", [8, 512])
def test_dense_pack_gqa_auto_no_sync(spin_cycles, sq):
    """pack_gqa=None picks packing from shapes the host already knows: no sync for short or long queries."""
    q, k, v = _dense(2, sq, 384, 8, 2, seed=3)
    out, _ = assert_no_sync(lambda: fa.flash_attn_func(q, k, v, causal=True, pack_gqa=None), spin_cycles,
                            f"dense forward, pack_gqa=None, sq={sq}")
    assert out.shape == q.shape


# ---------------------------------------------------------------- varlen forward

@pytest.mark.parametrize("used", ["none", "seqused_k", "seqused_q_k"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_fwd_max_seqlen_given_no_sync(spin_cycles, used, causal):
    q, k, v, cu_q, cu_k = _varlen(8, 2)
    kw = {}
    if used in ("seqused_k", "seqused_q_k"):
        kw["seqused_k"] = torch.tensor([30, 5, 0, 150], dtype=torch.int32, device="cuda")
    if used == "seqused_q_k":
        kw["seqused_q"] = torch.tensor([17, 0, 100, 1], dtype=torch.int32, device="cuda")
    call = lambda: fa.flash_attn_varlen_func(  # noqa: E731
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K),
        causal=causal, return_lse=True, **kw)
    out, lse = assert_no_sync(call, spin_cycles, f"varlen forward ({used}, causal={causal})")
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])


def test_kv_cache_seqused_k_no_sync(spin_cycles):
    """Dense q and a fixed-size KV cache with seqused_k, max_seqlen_k given."""
    q, k, v = _dense(3, 4, 512, 8, 2, seed=4)
    used_k = torch.tensor([512, 1, 300], dtype=torch.int32, device="cuda")
    call = lambda: fa.flash_attn_varlen_func(q, k, v, seqused_k=used_k, max_seqlen_q=4, max_seqlen_k=512,  # noqa: E731
                                             causal=True)
    out, _ = assert_no_sync(call, spin_cycles, "varlen forward, dense q + seqused_k")
    assert out.shape == q.shape


@pytest.mark.parametrize("lens", [([3, 1, 7], [40, 9, 100]), ([300, 2, 200], [300, 40, 250])],
                         ids=["short_q", "long_q"])
def test_varlen_pack_gqa_auto_no_sync(spin_cycles, lens):
    """pack_gqa=None on varlen decides from max_seqlen_q (given), not from cu_seqlens values on the host."""
    lens_q, lens_k = lens
    q, k, v, cu_q, cu_k = _varlen(8, 2, seed=5, lens_q=lens_q, lens_k=lens_k)
    call = lambda: fa.flash_attn_varlen_func(  # noqa: E731
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
        causal=True, pack_gqa=None)
    out, _ = assert_no_sync(call, spin_cycles, f"varlen forward, pack_gqa=None, lens_q={lens_q}")
    assert out.shape == q.shape


# ---------------------------------------------------------------- backward

@pytest.mark.parametrize("sink", [False, True])
def test_dense_fwd_bwd_no_sync(spin_cycles, sink):
    q, k, v = _dense(2, 200, 300, 8, 2, seed=6, grad=True)
    s = torch.randn(8, device="cuda", requires_grad=True) if sink else None
    inputs = (q, k, v) + ((s,) if sink else ())
    gout = torch.randn(q.shape, device="cuda").to(DT)

    def fwd_bwd():
        out, _ = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
        return torch.autograd.grad(out, inputs, gout)

    grads = assert_no_sync(fwd_bwd, spin_cycles, f"dense forward + backward (sink={sink})")
    assert all(g_.shape == t.shape for g_, t in zip(grads, inputs))


@pytest.mark.parametrize("seqused_k", [False, True])
def test_varlen_fwd_bwd_no_sync(spin_cycles, seqused_k):
    q, k, v, cu_q, cu_k = _varlen(8, 2, seed=7, grad=True)
    kw = {}
    if seqused_k:
        kw["seqused_k"] = torch.tensor([30, 5, 0, 150], dtype=torch.int32, device="cuda")
    gout = torch.randn(q.shape, device="cuda").to(DT)

    def fwd_bwd():
        out, _ = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
                                           max_seqlen_k=max(LENS_K), causal=True, **kw)
        return torch.autograd.grad(out, (q, k, v), gout)

    grads = assert_no_sync(fwd_bwd, spin_cycles, f"varlen forward + backward (seqused_k={seqused_k})")
    assert [g_.shape for g_ in grads] == [q.shape, k.shape, v.shape]


def test_backward_alone_no_sync(spin_cycles):
    """The backward by itself (graph built before the spin): the part a training step overlaps most."""
    q, k, v, cu_q, cu_k = _varlen(8, 2, seed=8, grad=True)
    gout = torch.randn(q.shape, device="cuda").to(DT)

    def fwd():
        return fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(LENS_Q),
                                         max_seqlen_k=max(LENS_K), causal=True)[0]

    torch.autograd.grad(fwd(), (q, k, v), gout)  # compile both directions
    out = fwd()
    grads = assert_no_sync(lambda: torch.autograd.grad(out, (q, k, v), gout, retain_graph=True), spin_cycles,
                           "varlen backward alone")
    assert grads[0].shape == q.shape


# ---------------------------------------------------------------- varlen without max_seqlen: may sync, must work

def test_varlen_without_max_seqlen_works():
    q, k, v, cu_q, cu_k = _varlen(8, 2, seed=9, grad=True)
    used_k = torch.tensor([30, 5, 0, 150], dtype=torch.int32, device="cuda")
    out, lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                         causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    ref, ref_lse = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k,
                                             max_seqlen_q=max(LENS_Q), max_seqlen_k=max(LENS_K), causal=True,
                                             return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=0)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert [g_.shape for g_ in grads] == [q.shape, k.shape, v.shape]
    torch.cuda.synchronize()
