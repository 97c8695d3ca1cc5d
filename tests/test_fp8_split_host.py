"""The host glue of FP8 split-KV and packed GQA on the CPU (dispatch_fp8.run_fp8_packed): the compiled kernel and
the combine replaced by torch models of their contracts (kernels/fwd_fp8.py's docstring, kernels/combine.py's), so
the configuration chosen, the grid arguments, the fp32 partials' views and the combine's layouts are checked end to
end without a GPU.  A wrong partial view, a split written into the wrong slot or an LSE transposed the wrong way
makes the split result differ from the unsplit one by the size of the output."""

import contextlib
import math
import types

import pytest
import torch

from flash_attn_4_sm120 import config_fp8, device, splitkv
from flash_attn_4_sm120 import dispatch_fp8 as F8
from tests.fp8_emulation import quantize_rows

E4 = torch.float8_e4m3fn
TILE_N = config_fp8.FP8_TILE_N


def _model_kernel(cfg, calls):
    """The FP8 kernel's contract in torch (non-causal, no window, no sink): per sequence b, head h, query row i,
    softmax over keys cu_k[b] .. + used_k[b]; with cfg.split, split s of out.shape[0] takes the run of
    ceil(tiles / splits) 64-key tiles and writes its own normalised O (fp32) and natural-log LSE at [s].  With
    cfg.softcap the scores are softcap_log2 / log2(e) · tanh(x / (2 log2(e))), x the raw score times scale_log2
    and the descales (the kernel's arguments: dispatch_fp8.fp8_scales)."""

    def fn(q, k, v, out, lse, qd, kd, vd, sink, cu_q, cu_k, used_k, page_table, scale_log2, softcap_log2, left,
           right, ratio, num_m_blocks):
        calls.append(dict(cfg=cfg, out_shape=tuple(out.shape), lse_shape=tuple(lse.shape), ratio=ratio,
                          num_m_blocks=num_m_blocks, cu_k=cu_k, page_table=page_table, left=left, right=right))
        assert cfg.paged == (page_table is not None) and (cu_k is None) == cfg.paged
        row_qd = None
        if cfg.q_dtype == "e4m3":
            qf = q.view(E4).float()[0]
        else:  # the kernel quantizes each (row, head) of a bf16/fp16 q itself (tests/fp8_emulation.quantize_rows)
            assert qd is None and q.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.q_dtype]
            q8, row_qd = quantize_rows(q[0])
            qf = q8.float()
        if cfg.paged:  # the paged form's contract: key j of b is row j % ps of the clamped page of column j // ps
            ps, last = k.shape[1], k.shape[0] - 1
            cols = torch.arange(page_table.shape[1] * ps) // ps
            rows_of = [page_table[b].long()[cols].clamp(0, last) * ps + torch.arange(cols.shape[0]) % ps
                       for b in range(page_table.shape[0])]
            pools = [x.view(E4).float().flatten(0, 1) for x in (k, v)]
        else:
            kf, vf = (x.view(E4).float()[0] for x in (k, v))
        splits = out.shape[0] if cfg.split else 1
        for b in range(cu_q.shape[0] - 1):
            q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
            sk = max(int(used_k[b]), 0)
            if cfg.paged:
                sk = min(sk, rows_of[b].shape[0])
                k0, kf, vf = 0, pools[0][rows_of[b]], pools[1][rows_of[b]]
            else:
                k0 = int(cu_k[b])
            per = -(-(-(-sk // TILE_N)) // splits) * TILE_N if sk else 0
            for s in range(splits):
                lo, hi = min(s * per, sk), min((s + 1) * per, sk)
                for h in range(qf.shape[1]):
                    g = h // ratio
                    q_scale = qd[b, g] if row_qd is None else row_qd[q0:q1, h, None]
                    if cfg.softcap:
                        x = (qf[q0:q1, h] @ kf[k0 + lo:k0 + hi, g].T) * scale_log2 * q_scale * kd[b, g]
                        sc = softcap_log2 / math.log2(math.e) * torch.tanh(x / (2 * math.log2(math.e)))
                    else:
                        sc = (qf[q0:q1, h] @ kf[k0 + lo:k0 + hi, g].T) * (scale_log2 / math.log2(math.e)) \
                            * q_scale * kd[b, g]
                    if hi > lo:
                        p = torch.softmax(sc, -1)
                        o, l_ = p @ vf[k0 + lo:k0 + hi, g] * vd[b, g], torch.logsumexp(sc, -1)
                    else:
                        o = torch.zeros(q1 - q0, vf.shape[-1])
                        l_ = torch.full((q1 - q0,), -math.inf)
                    if cfg.split:
                        out[s, q0:q1, h], lse[s, h, q0:q1] = o, l_
                    else:
                        out[0, q0:q1, h], lse[0, h, q0:q1] = o.to(out.dtype), l_

    return fn


def _model_combine(o_comb, l_comb, out, lse, varlen_q):
    """kernels/combine.py's contract on (splits, 1, total, H, D) / (splits, 1, total, H) partials."""
    assert not varlen_q
    big = torch.logsumexp(l_comb, 0)  # (1, total, H); -inf where every split is empty
    w = torch.where(torch.isinf(big)[None], torch.zeros_like(l_comb), torch.exp(l_comb - big[None]))
    w = torch.nan_to_num(w)  # an empty split (-inf) of a non-empty row weighs 0
    # an empty split's partial is never read (it may hold anything: the workspace is torch.empty)
    out.copy_(torch.where(w[..., None] > 0, w[..., None] * o_comb, 0.0).sum(0).to(out.dtype))
    lse.copy_(big.transpose(1, 2))


@pytest.fixture
def model(monkeypatch):
    calls = []
    caps = types.SimpleNamespace(arch="sm_120a", pdl=True, describe=lambda: "a modelled 12.0 device")
    monkeypatch.setattr(device, "device_caps", lambda dev: caps)
    monkeypatch.setattr(config_fp8, "check_target", lambda arch, text: None)
    monkeypatch.setattr(F8, "get_fp8_kernel", lambda cfg, dev: _model_kernel(cfg, calls))
    monkeypatch.setattr(splitkv, "combine_into", _model_combine)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    return calls


def _inputs(lens_q, lens_k, hq, hkv, d=64, extra_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_q = sum(lens_q) + extra_rows
    q = torch.randn(1, total_q, hq, d, generator=g).to(E4)
    k = torch.randn(1, sum(lens_k), hkv, d, generator=g).to(E4)
    v = torch.randn(1, sum(lens_k), hkv, d, generator=g).to(E4)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    desc = tuple(torch.rand(len(lens_q), hkv, generator=g) + 0.5 for _ in range(3))
    return q, k, v, cu_q, cu_k, cu_k[1:] - cu_k[:-1], desc


def _run(args, max_q, **kw):
    q, k, v, cu_q, cu_k, used, desc = args
    return F8.run_fp8_packed(q, k, v, cu_q, cu_k, used, max_q, desc, softmax_scale=None, causal=False,
                             out_name="bf16", out_dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_partials_and_combine_layouts_give_the_unsplit_result(model, pack_gqa, splits):
    lens_q, lens_k = [1, 2, 0, 1], [300, 0, 40, 700]
    args = _inputs(lens_q, lens_k, hq=8, hkv=2, extra_rows=2)
    out_1, lse_1 = _run(args, 2, pack_gqa=pack_gqa, num_splits=1)
    out_n, lse_n = _run(args, 2, pack_gqa=pack_gqa, num_splits=splits, max_seqlen_k=700, rows_covered=False)
    one, split = model
    # packed: 2 rows x 4 heads = 8 rows, the decode tile; unpacked: the 64-row tile over Hq heads
    assert (one["cfg"].pack_gqa, one["cfg"].split, one["cfg"].tile_m) == (pack_gqa, False, 16 if pack_gqa else 64)
    assert (split["cfg"].pack_gqa, split["cfg"].split, split["cfg"].out_dtype) == (pack_gqa, True, "fp32")
    assert split["cfg"].tile_m == one["cfg"].tile_m and one["num_m_blocks"] == split["num_m_blocks"] == 1
    assert split["out_shape"] == (splits, 6, 8, 64) and split["lse_shape"] == (splits, 8, 6)
    assert one["ratio"] == 4
    used = sum(lens_q)
    torch.testing.assert_close(out_n[:, :used].float(), out_1[:, :used].float(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(lse_n[..., :used], lse_1[..., :used], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse_n[..., used:]).all() and (out_n[:, used:] == 0).all()  # rows in no sequence
    assert torch.isneginf(lse_n[0, :, 1:3]).all() and (out_n[0, 1:3] == 0).all()  # the keyless sequence


def test_split_count_is_checked_before_the_launch(model):
    args = _inputs([1], [300], hq=4, hkv=4)
    with pytest.raises(ValueError, match="num_splits"):
        _run(args, 1, num_splits=10 ** 6)
    assert not model
