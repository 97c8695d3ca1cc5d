"""Reliability regressions (GPU): garbage in rows no sequence uses, output rows outside every sequence, NaN that
must propagate instead of hiding, a corrupt compile cache seen by a fresh process, launch limits and bad scalars
that must be refused before any launch (also under CUDA-graph capture)."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reference import attention_ref, varlen_ref

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

fa = pytest.importorskip("flash_attn_4_sm120")

ROOT = Path(__file__).resolve().parents[1]


def _rand(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so an output the kernel forgets to write shows up."""
    blocks = [torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda") for _ in range(4)]
    del blocks


def _cu(lens, start=0):
    return torch.tensor([start + x for x in [0] + torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


# ---- output rows outside every sequence ------------------------------------------------------------------------
LAYOUTS = ["tail", "lead_and_tail", "seqused_q", "dense_seqused_q"]


def _case(layout, hq, hkv, d, gen):
    """(q, k, v, kwargs, inside-row mask over q's rows (varlen) or (B, Sq) (dense))."""
    lens_q, lens_k = [37, 0, 113], [50, 9, 200]
    if layout == "dense_seqused_q":
        q = _rand(3, 120, hq, d, gen=gen)
        k, v = _rand(3, 200, hkv, d, gen=gen), _rand(3, 200, hkv, d, gen=gen)
        used_q = torch.tensor([37, 0, 113], dtype=torch.int32, device="cuda")
        inside = torch.arange(120, device="cuda")[None, :] < used_q[:, None]
        return q, k, v, dict(seqused_q=used_q, max_seqlen_q=120), inside
    lead = 11 if layout == "lead_and_tail" else 0
    tail = 29
    total_q = lead + sum(lens_q) + tail
    q = _rand(total_q, hq, d, gen=gen)
    k = _rand(sum(lens_k), hkv, d, gen=gen)
    v = _rand(sum(lens_k), hkv, d, gen=gen)
    cu_q, cu_k = _cu(lens_q, lead), _cu(lens_k)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=113, max_seqlen_k=200)
    inside = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    inside[lead:lead + sum(lens_q)] = True
    if layout == "seqused_q":
        used_q = torch.tensor([20, 0, 113], dtype=torch.int32, device="cuda")
        kw["seqused_q"] = used_q
        inside[lead + 20:lead + 37] = False
    return q, k, v, kw, inside


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [128, 256])  # TMA kernel (d <= 192) and cp.async kernel
@pytest.mark.parametrize("hq,hkv,pack_gqa", [(4, 4, False), (8, 2, True)])
def test_out_of_sequence_rows_are_written(layout, d, hq, hkv, pack_gqa):
    g = torch.Generator(device="cuda").manual_seed(31)
    q, k, v, kw, inside = _case(layout, hq, hkv, d, g)
    _poison_allocator(q.numel() * 2 * 4)
    out, lse = fa.flash_attn_varlen_func(q, k, v, causal=True, pack_gqa=pack_gqa, return_lse=True, **kw)
    outside = ~inside
    assert outside.any()
    if layout == "dense_seqused_q":
        assert (out[outside] == 0).all(), "rows past seqused_q: O = 0"
        assert (lse.transpose(1, 2)[outside] == -math.inf).all(), "rows past seqused_q: LSE = -inf"
        for b in range(q.shape[0]):
            n = int(inside[b].sum())
            ref, lse_ref = attention_ref(q[b:b + 1, :n], k[b:b + 1], v[b:b + 1], causal=True)
            torch.testing.assert_close(out[b:b + 1, :n].float(), ref.float(), atol=2e-2, rtol=0)
            fin = torch.isfinite(lse_ref)
            torch.testing.assert_close(lse[b:b + 1, :, :n][fin], lse_ref[fin], atol=1e-3, rtol=1e-3)
        return
    assert (out[outside] == 0).all(), "rows outside every sequence: O = 0"
    assert (lse[:, outside] == -math.inf).all(), "rows outside every sequence: LSE = -inf"
    ref, lse_ref = varlen_ref(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw.get("seqused_q"), causal=True)
    rows = inside & ~torch.isnan(ref[:, 0, 0])
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("layout", ["tail", "seqused_q"])
def test_out_of_sequence_rows_get_zero_gradients(layout):
    g = torch.Generator(device="cuda").manual_seed(32)
    q, k, v, kw, inside = _case(layout, 8, 2, 128, g)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    _poison_allocator(q.numel() * 2 * 4)
    out, _ = fa.flash_attn_varlen_func(q, k, v, causal=True, **kw)
    assert torch.isfinite(out).all(), "a loss over the whole padded buffer must be finite"
    out.float().square().sum().backward()
    for name, gr in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(gr).all(), name
    assert (q.grad[~inside] == 0).all(), "dq of rows outside every sequence is 0"


# ---- garbage in rows no sequence uses reaches neither the output nor the gradients ----------------------------
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_nan_in_unused_kv_rows_changes_no_gradient(d, causal, deterministic):
    """Bitwise for every output but the default's dQ: the fused backward adds each query tile's dQ from several key
    tiles in fp32 in an order that varies from run to run (kernels/bwd_dkdv.py), so two clean runs may already
    differ in the last bits there; that dQ must be finite and within fp32 rounding of the clean one.
    deterministic=True is bitwise everywhere."""
    g = torch.Generator(device="cuda").manual_seed(33)
    q, k, v = _rand(2, 70, 4, d, gen=g), _rand(2, 300, 2, d, gen=g), _rand(2, 300, 2, d, gen=g)
    used_k = torch.tensor([77, 200], dtype=torch.int32, device="cuda")
    dout = _rand(2, 70, 4, d, gen=g)
    k_nan, v_nan = k.clone(), v.clone()
    for b, n in enumerate(used_k.tolist()):
        k_nan[b, n:], v_nan[b, n:] = float("nan"), float("nan")
    grads = []
    for kk, vv in ((k, v), (k_nan, v_nan)):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, kk, vv))
        out, _ = fa.flash_attn_varlen_func(qq, kk, vv, seqused_k=used_k, max_seqlen_k=300, causal=causal,
                                           deterministic=deterministic)
        out.backward(dout)
        grads.append((out.detach(), qq.grad, kk.grad, vv.grad))
    clean, dirty = grads
    assert torch.equal(clean[0], dirty[0]), "the output does not depend on unused K/V rows"
    assert torch.isfinite(dirty[1]).all(), "no NaN of an unused K/V row reaches dq"
    if deterministic:
        assert torch.equal(clean[1], dirty[1]), "dq does not depend on unused K/V rows"
    else:  # one bf16 ulp of the largest entry: the fp32 sums of two add orders, rounded to bf16
        bar = clean[1].float().abs().max().item() * 2.0 ** -7
        assert (clean[1].float() - dirty[1].float()).abs().max().item() <= bar
    for b, n in enumerate(used_k.tolist()):
        for i in (2, 3):
            assert torch.equal(clean[i][b, :n], dirty[i][b, :n])
            assert (dirty[i][b, n:] == 0).all(), "dk/dv of unused rows are 0"


# ---- NaN propagates, never hides -------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [128, 256])
def test_nan_sink_propagates_to_its_head(d):
    g = torch.Generator(device="cuda").manual_seed(34)
    q, k, v = _rand(2, 65, 4, d, gen=g), _rand(2, 90, 4, d, gen=g), _rand(2, 90, 4, d, gen=g)
    sink = torch.randn(4, device="cuda")
    sink[1] = float("nan")
    out, lse = fa.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    assert torch.isnan(out[:, :, 1]).all() and torch.isnan(lse[:, 1]).all(), "a NaN sink must not be hidden"
    keep = [0, 2, 3]
    ref, lse_ref = attention_ref(q[:, :, keep], k[:, :, keep], v[:, :, keep], sink=sink[keep])
    torch.testing.assert_close(out[:, :, keep].float(), ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse[:, keep], lse_ref, atol=1e-3, rtol=1e-3)


def test_nan_scores_propagate():
    g = torch.Generator(device="cuda").manual_seed(35)
    q, k, v = _rand(1, 64, 2, 128, gen=g), _rand(1, 64, 2, 128, gen=g), _rand(1, 64, 2, 128, gen=g)
    k[0, 5, 0, 0] = float("nan")  # a used key: every row of head 0 sees it
    out, lse = fa.flash_attn_func(q, k, v, return_lse=True)
    assert torch.isnan(out[0, :, 0]).all() and torch.isnan(lse[0, 0]).all()
    assert torch.isfinite(out[0, :, 1]).all()


def test_minus_inf_sink_on_rows_without_keys_is_empty_not_nan():
    """Causal with Sq > Sk: the first rows see no key; with a -inf sink they have nothing at all."""
    g = torch.Generator(device="cuda").manual_seed(36)
    q, k, v = _rand(1, 100, 2, 128, gen=g), _rand(1, 40, 2, 128, gen=g), _rand(1, 40, 2, 128, gen=g)
    sink = torch.tensor([-math.inf, 0.5], device="cuda")
    out, lse = fa.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    ref, lse_ref = attention_ref(q, k, v, causal=True, sink=sink)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, :60, 0] == 0).all() and (lse[0, 0, :60] == -math.inf).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)


# ---- launch limits and bad scalars: clear errors before any launch ---------------------------------------------
def test_head_count_past_the_grid_limit_is_refused():
    q = torch.zeros(1, 1, 65536, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 1, 32, device="cuda", dtype=torch.bfloat16)
    for kv in ((k, k), (q, q)):
        with pytest.raises(ValueError, match="65535"):
            fa.flash_attn_func(q, *kv)
    with pytest.raises(ValueError, match="65535"):  # the backward's dQ grid too: refused before the forward runs
        fa.flash_attn_func(q.clone().requires_grad_(), k, k)


@pytest.mark.parametrize("kw,needle", [
    (dict(softcap=1e-41), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(max_seqlen_k=2.5), "max_seqlen_k"),
    (dict(learnable_sink=[0.0, 0.0]), "learnable_sink"),
    (lambda: dict(cu_seqlens_q=torch.tensor(0, dtype=torch.int32, device="cuda")), "cu_seqlens_q"),
    (lambda: dict(seqused_k=torch.zeros(1, 2, dtype=torch.int32, device="cuda")), "seqused_k"),
], ids=["tiny_softcap", "inf_softcap", "nan_scale", "negative_max_seqlen", "fractional_max_seqlen", "sink_list",
        "cu_0d", "seqused_2d"])
def test_bad_scalars_and_types_are_refused(kw, needle):
    q = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    base = dict(cu_seqlens_q=_cu([16]), cu_seqlens_k=_cu([16]), max_seqlen_q=16, max_seqlen_k=16)
    base.update(kw() if callable(kw) else kw)
    with pytest.raises((ValueError, TypeError)) as info:
        fa.flash_attn_varlen_func(q, q, q, **base)
    assert needle in str(info.value), str(info.value)


def test_negative_max_seqlen_under_capture_raises_and_keeps_the_capture():
    q = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = _cu([16])
    fa.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)  # warm
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            with pytest.raises(ValueError, match="max_seqlen_q"):
                fa.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=-3,
                                          max_seqlen_k=16)
            out, _ = fa.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16,
                                               max_seqlen_k=16)
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = fa.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)
    assert torch.equal(out, ref)


# ---- a corrupt compile-cache entry, seen by a fresh process ----------------------------------------------------
_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import flash_attn_4_sm120 as fa
    from reference import attention_ref
    g = torch.Generator(device="cuda").manual_seed(1)
    err = 0.0
    for d in (64, 128):  # two cache entries, so one can be swapped for the other
        q, k, v = (torch.randn(1, 77, 2, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        out, _ = fa.flash_attn_func(q, k, v, causal=True)
        ref, _ = attention_ref(q, k, v, causal=True)
        err = max(err, (out.float() - ref.float()).abs().max().item())
    print("ERR", err)
    sys.exit(0 if err < 2e-2 else 3)
""")


def _child(cache: Path):
    env = dict(os.environ, FA4_SM120_CACHE_DIR=str(cache))
    env.pop("FA4_SM120_DISK_CACHE", None)
    code = _CHILD.format(tests=str(ROOT / "tests"))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage", ["truncate_so", "zero_cubin_bytes", "swap_key"])
def test_corrupt_cache_entry_heals_in_a_fresh_process(tmp_path, damage):
    first = _child(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    manifests = sorted(tmp_path.rglob("*.json"))
    assert manifests, "the first process wrote the cache"
    target = manifests[0]
    so, obj = target.with_suffix(".so"), target.with_suffix(".o")
    victim = so if so.exists() else obj
    if damage == "truncate_so":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "zero_cubin_bytes":
        data = bytearray(victim.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 1024] = bytes(1024)
        victim.write_bytes(bytes(data))
    else:  # another entry's files under this key
        other = manifests[1] if len(manifests) > 1 else None
        if other is None:
            pytest.skip("one cache entry only")
        for suffix in (".so", ".o"):
            src = other.with_suffix(suffix)
            if src.exists():
                target.with_suffix(suffix).write_bytes(src.read_bytes())
    second = _child(tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert str(target.stem) in second.stderr, "one warning names the bad entry:\n" + second.stderr
    m = json.loads(target.read_text())
    assert victim.name in m["sha256"] or obj.name in m["sha256"], "the entry was rewritten with a manifest"
    third = _child(tmp_path)
    assert third.returncode == 0 and "does not match" not in third.stderr, third.stderr
