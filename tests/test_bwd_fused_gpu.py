"""The fused backward on a GPU: it is the default where config_bwd.select_fused_config gives a tile, its gradients
meet the fp32 bar (tests/test_bwd_gpu.py's check), ``deterministic=True`` runs its relay form (kernels/dq_relay.py)
where it has a tile, which meets the same bar, agrees with the atomic-free pair and is bitwise reproducible under
concurrent load (causal, window, varlen with empty sequences, GQA, dropout, d64/d96/d128), and the fused path works
under CUDA-graph capture and torch.compile."""

import pytest
import torch

from bwd_gpu_helpers import rand_grad as _rand, spy_fused_plan
from test_bwd_gpu import check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flash_attn_4_sm120 import dispatch_bwd  # noqa: E402


@pytest.mark.parametrize("d,causal,fused", [(64, False, True), (64, True, True), (128, False, True),
                                            (128, True, True), (96, True, True), (192, False, False),
                                            (256, False, True)])
def test_default_takes_the_fused_path_where_it_has_a_tile(monkeypatch, d, causal, fused):
    seen = spy_fused_plan(monkeypatch)
    q, k, v = _rand(2, 113, 4, d), _rand(2, 211, 2, d, seed=1), _rand(2, 211, 2, d, seed=2)
    check(q, k, v, causal=causal)
    assert seen and (seen[0] is not None) is fused


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (255, 1023)])
def test_fused_matches_reference(hq, hkv, d, sq, sk):
    q, k, v = _rand(2, sq, hq, d), _rand(2, sk, hkv, d, seed=1), _rand(2, sk, hkv, d, seed=2)
    check(q, k, v, causal=False)
    if d == 64:
        check(q, k, v, causal=True)
        check(q, k, v, window_size=(32, 16))


def test_fused_fp16_softcap_dropout():
    q, k, v = (_rand(2, 177, 4, 64, dtype=torch.float16, seed=s) for s in range(3))
    check(q, k, v, causal=True, softcap=5.0)
    # dropout: fused and the pair apply the same keep mask, so their gradients agree to accumulation order
    outs = []
    for det in (False, True):
        out = fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.2, dropout_seed=7, deterministic=det)[0]
        outs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*outs):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * b.float().abs().max().item() + 1e-3


def test_fused_varlen_with_empty_sequences():
    lens_q, lens_k = [0, 17, 113, 1, 0, 64], [5, 17, 200, 0, 3, 64]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    for d in (64, 128):
        q = _rand(sum(lens_q), 4, d)
        k, v = _rand(sum(lens_k), 2, d, seed=1), _rand(sum(lens_k), 2, d, seed=2)
        grads = []
        for det in (False, True):
            out = fa.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=113,
                                            max_seqlen_k=200, deterministic=det)[0]
            grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        for a, b in zip(*grads):  # the pair is checked against the reference in test_bwd_gpu.test_bwd_varlen
            assert torch.isfinite(a).all()
            assert (a.float() - b.float()).abs().max().item() <= 1e-2 * b.float().abs().max().item() + 1e-3


def _grads(det, q, k, v, g):
    out = fa.flash_attn_func(q, k, v, causal=False, deterministic=det)[0]
    return torch.autograd.grad(out, (q, k, v), g)


def test_deterministic_is_bitwise_reproducible_under_load():
    q, k, v = _rand(2, 1024, 8, 64), _rand(2, 1024, 2, 64, seed=1), _rand(2, 1024, 2, 64, seed=2)
    g = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    first = _grads(True, q, k, v, g)
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        with torch.cuda.stream(side):  # concurrent work competes for the SMs
            for _ in range(4):
                a = a @ a / 64
        again = _grads(True, q, k, v, g)
        for x, y in zip(first, again):
            assert torch.equal(x, y)
    torch.cuda.synchronize()


def test_default_mode_stays_within_the_bar_run_to_run():
    q, k, v = _rand(2, 1024, 8, 64), _rand(2, 1024, 2, 64, seed=1), _rand(2, 1024, 2, 64, seed=2)
    g = torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)
    ref = _grads(True, q, k, v, g)
    for _ in range(3):
        for x, y in zip(_grads(False, q, k, v, g), ref):  # the adds' order may differ: not bitwise
            assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item() + 1e-3


def test_fused_backward_under_cuda_graph_capture():
    q, k, v = _rand(2, 256, 4, 64), _rand(2, 256, 4, 64, seed=1), _rand(2, 256, 4, 64, seed=2)
    g = torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    eager = _grads(True, q, k, v, g)
    _grads(False, q, k, v, g)  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _grads(False, q, k, v, g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _grads(False, q, k, v, g)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, eager):
        assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item() + 1e-3


def test_fused_backward_under_torch_compile():
    q, k, v = _rand(2, 128, 4, 64), _rand(2, 128, 4, 64, seed=1), _rand(2, 128, 4, 64, seed=2)

    def f(q, k, v):
        return fa.flash_attn_func(q, k, v, causal=True)[0].float().square().sum()
    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    comp = torch.autograd.grad(torch.compile(f, fullgraph=False)(q, k, v), (q, k, v))
    for x, y in zip(comp, eager):
        assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item() + 1e-3


def test_deterministic_flag_is_checked():
    q = _rand(1, 8, 1, 64)
    with pytest.raises(ValueError, match="deterministic"):
        fa.flash_attn_func(q, q, q, deterministic="yes")


# ---- deterministic=True: the relay form ----------------------------------------------------------------------
@pytest.mark.parametrize("d,causal,relay", [(64, False, True), (64, True, True), (96, True, False),
                                            (128, False, True), (128, True, True), (192, False, False),
                                            (256, True, False)])
def test_relay_runs_where_the_fused_kernel_serves(monkeypatch, d, causal, relay):
    """By default (config_bwd.RELAY_HEAD_DIMS) the relay serves d64 and d128; d96 keeps the pair."""
    configs = []
    spy_fused_plan(monkeypatch, configs)
    q, k, v = _rand(2, 113, 4, d), _rand(2, 211, 2, d, seed=1), _rand(2, 211, 2, d, seed=2)
    check(q, k, v, causal=causal, deterministic=True)
    assert configs
    if relay:
        assert configs[0] is not None and configs[0].fused_dq and configs[0].dq_relay
    else:
        assert configs[0] is None


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (7, 1)])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 113), (255, 1023), (700, 300)])
def test_relay_matches_reference(wide_relay, hq, hkv, d, sq, sk):
    q, k, v = _rand(2, sq, hq, d), _rand(2, sk, hkv, d, seed=1), _rand(2, sk, hkv, d, seed=2)
    check(q, k, v, causal=False, deterministic=True)
    check(q, k, v, causal=True, deterministic=True)
    check(q, k, v, window_size=(32, 16), deterministic=True)


def _det_grads(call, inputs, g):
    out = call(*inputs)[0]
    return torch.autograd.grad(out, inputs, g)


def _relay_cases():
    """(name, call, inputs): calls the relay serves, each with many key tiles per query tile."""
    lens_q, lens_k = [0, 17, 1113, 1, 0, 640], [5, 17, 2000, 0, 3, 640]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cases = []
    for d in (64, 96, 128):
        # 2048 keys: 16 key tiles of 128 or more, so causal and windowed walks take the LPT launch order too
        dense = (_rand(2, 2048, 8, d), _rand(2, 2048, 2, d, seed=1), _rand(2, 2048, 2, d, seed=2))
        cases += [
            (f"d{d}", lambda q, k, v: fa.flash_attn_func(q, k, v, deterministic=True), dense),
            (f"d{d}-causal", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, deterministic=True), dense),
            (f"d{d}-window", lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=(300, 64),
                                                               deterministic=True), dense),
            (f"d{d}-dropout", lambda q, k, v: fa.flash_attn_func(q, k, v, causal=True, dropout_p=0.1,
                                                                dropout_seed=3, deterministic=True), dense),
            (f"d{d}-varlen", lambda q, k, v: fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1113, max_seqlen_k=2000, causal=True,
                deterministic=True),
             (_rand(sum(lens_q), 8, d), _rand(sum(lens_k), 1, d, seed=1), _rand(sum(lens_k), 1, d, seed=2))),
        ]
    return cases


def test_relay_bitwise_reproducible_under_load(wide_relay, monkeypatch):
    configs = []
    spy_fused_plan(monkeypatch, configs)
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    for name, call, inputs in _relay_cases():
        configs.clear()
        g = torch.randn_like(call(*inputs)[0])
        first = _det_grads(call, inputs, g)
        assert configs and configs[-1] is not None and configs[-1].dq_relay, name  # the relay ran, not the pair
        for _ in range(3):
            with torch.cuda.stream(side):  # concurrent work competes for the SMs
                for _ in range(4):
                    a = a @ a / 64
            again = _det_grads(call, inputs, g)
            for x, y in zip(first, again):
                assert torch.equal(x, y), name
    torch.cuda.synchronize()


def test_relay_agrees_with_the_pair(wide_relay, monkeypatch):
    """The relay and the atomic-free pair (forced by hiding the fused kernel) add the same products in different
    orders: equal to fp32 rounding, for every case above (the pair meets the reference in tests/test_bwd_gpu.py)."""
    for name, call, inputs in _relay_cases():
        g = torch.randn_like(call(*inputs)[0])
        relay = _det_grads(call, inputs, g)
        with monkeypatch.context() as m:
            m.setattr(dispatch_bwd, "fused_plan", lambda plan, device, relay=False: None)
            pair = _det_grads(call, inputs, g)
        for x, y in zip(relay, pair):
            assert torch.isfinite(x).all(), name
            assert (x.float() - y.float()).abs().max().item() <= 1e-2 * y.float().abs().max().item() + 1e-3, name
