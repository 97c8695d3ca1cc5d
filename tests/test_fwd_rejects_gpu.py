"""Every rejected input raises a clear error before any kernel launch (GPU: the inputs must be CUDA tensors)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

fa = pytest.importorskip("flash_attn_4_sm120")


def t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


def qkv(b=1, s=16, hq=4, hkv=4, d=64, dv=64, dtype=torch.bfloat16):
    return t(b, s, hq, d, dtype=dtype), t(b, s, hkv, d, dtype=dtype), t(b, s, hkv, dv, dtype=dtype)


CASES = {
    "fp32 inputs": (lambda: qkv(dtype=torch.float32), {}, ValueError, "dtype"),
    "mixed dtypes": (lambda: (t(1, 16, 4, 64), t(1, 16, 4, 64, dtype=torch.float16), t(1, 16, 4, 64)), {},
                     ValueError, "one dtype"),
    "cpu tensor": (lambda: (t(1, 16, 4, 64).cpu(), t(1, 16, 4, 64), t(1, 16, 4, 64)), {}, ValueError, "CUDA"),
    "rank 3 q": (lambda: (t(16, 4, 64), t(1, 16, 4, 64), t(1, 16, 4, 64)), {}, ValueError, "4 dimensions"),
    "head_dim 80": (lambda: qkv(d=80, dv=80), {}, ValueError, "head_dim=80"),
    "head_dim 512": (lambda: qkv(d=512, dv=512), {}, ValueError, "head_dim=512"),
    "dv > d": (lambda: qkv(d=64, dv=128), {}, ValueError, "head_dim_v=128"),
    "k head_dim mismatch": (lambda: (t(1, 16, 4, 64), t(1, 16, 4, 128), t(1, 16, 4, 64)), {}, ValueError,
                            "k.shape[-1]"),
    "heads not multiple": (lambda: qkv(hq=6, hkv=4), {}, ValueError, "multiple"),
    "k/v head mismatch": (lambda: (t(1, 16, 4, 64), t(1, 16, 2, 64), t(1, 16, 4, 64)), {}, ValueError, "heads"),
    "batch mismatch": (lambda: (t(2, 16, 4, 64), t(1, 16, 4, 64), t(1, 16, 4, 64)), {}, ValueError, "batch"),
    "last dim strided": (lambda: (t(1, 16, 4, 128)[..., ::2], t(1, 16, 4, 64), t(1, 16, 4, 64)), {}, ValueError,
                         "contiguous"),
    "misaligned rows": (lambda: (t(1, 16, 4, 68)[..., :64], t(1, 16, 4, 64), t(1, 16, 4, 64)), {}, ValueError,
                        "16-byte"),
    "negative scale": (lambda: qkv(), {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    "nan softcap": (lambda: qkv(), {"softcap": float("nan")}, ValueError, "softcap"),
    "bad window": (lambda: qkv(), {"window_size": (1.5, None)}, ValueError, "window_size"),
    "sink shape": (lambda: qkv(), lambda: {"learnable_sink": torch.zeros(3, device="cuda")}, ValueError, "(4,)"),
    "sink dtype": (lambda: qkv(), lambda: {"learnable_sink": torch.zeros(4, device="cuda", dtype=torch.int32)},
                   ValueError, "dtype"),
    "split kv above the combine's limit": (lambda: qkv(), {"num_splits": 300}, ValueError, "num_splits=300"),
    "split kv past grid z": (lambda: qkv(b=300, s=1), {"num_splits": 256}, ValueError, "grid limit"),
    "split kv float": (lambda: qkv(), {"num_splits": 2.0}, ValueError, "num_splits must be an int"),
    "block sparse type": (lambda: qkv(), {"block_sparse_tensors": object()}, ValueError, "BlockSparseTensors"),
    "dropout out of range": (lambda: qkv(), {"dropout_p": 1.5}, ValueError, "dropout_p"),
    "dropout with split kv": (lambda: qkv(), {"dropout_p": 0.1, "num_splits": 2}, ValueError, "num_splits"),
    "dropout with a mask_mod at d256": (lambda: qkv(d=256, dv=256), {"dropout_p": 0.1, "mask_mod": lambda *a: a[2]},
                                        ValueError, "<= 192"),
    "score_mod with softcap": (lambda: qkv(), {"score_mod": lambda *a, **kw: a[0], "softcap": 5.0}, ValueError,
                               "softcap"),
    "score_mod_bwd alone": (lambda: qkv(), {"score_mod_bwd": lambda *a, **kw: a[0]}, ValueError, "score_mod_bwd"),
    "aux without mods": (lambda: qkv(), lambda: {"aux_tensors": [torch.zeros(3, device="cuda")]}, ValueError,
                         "aux_tensors"),
    "aux on cpu": (lambda: qkv(), lambda: {"mask_mod": lambda *a: a[2], "aux_tensors": [torch.zeros(3)]},
                   ValueError, "aux_tensors[0] is on cpu"),
    "aux_scalars": (lambda: qkv(), {"aux_scalars": (1,)}, NotImplementedError, "aux_scalars"),
    "pack_gqa type": (lambda: qkv(hq=8, hkv=2), {"pack_gqa": "yes"}, ValueError, "pack_gqa"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rejects(name):
    make, kwargs, exc, needle = CASES[name]
    q, k, v = make()
    kwargs = kwargs() if callable(kwargs) else kwargs
    with pytest.raises(exc, match=None) as info:
        fa.flash_attn_func(q, k, v, **kwargs)
    assert needle in str(info.value), str(info.value)


def test_positional_args_after_v_rejected():
    q, k, v = qkv()
    with pytest.raises(TypeError):
        fa.flash_attn_func(q, k, v, None, True)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


VARLEN_CASES = {
    "cu int64": (lambda: dict(cu_seqlens_q=_cu([8, 8]).long(), cu_seqlens_k=_cu([8, 8])), ValueError, "int32"),
    "cu not monotonic": (lambda: dict(cu_seqlens_q=torch.tensor([0, 10, 4], dtype=torch.int32, device="cuda"),
                              cu_seqlens_k=_cu([8, 8])), ValueError, "non-decreasing"),
    "cu past total": (lambda: dict(cu_seqlens_q=_cu([8, 9]), cu_seqlens_k=_cu([8, 8])), ValueError, "16"),
    "cu batch mismatch": (lambda: dict(cu_seqlens_q=_cu([8, 8]), cu_seqlens_k=_cu([4, 4, 8])), ValueError, "shape (3,)"),
    "max_seqlen too small": (lambda: dict(cu_seqlens_q=_cu([8, 8]), cu_seqlens_k=_cu([8, 8]), max_seqlen_q=4),
                             ValueError, "max_seqlen_q"),
    "seqused too long": (lambda: dict(cu_seqlens_q=_cu([8, 8]), cu_seqlens_k=_cu([8, 8]),
                              seqused_k=torch.tensor([9, 1], dtype=torch.int32, device="cuda")), ValueError,
                         "seqused_k[0]"),
    "page table": (lambda: dict(cu_seqlens_q=_cu([8, 8]), cu_seqlens_k=_cu([8, 8]),
                        page_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda")), ValueError,
                   "page_table cannot be combined with cu_seqlens_k"),
}


# Metadata values (not shapes or dtypes) are the caller's contract: checked on the host only with debug checks on.
_VALUE_LIES = {"cu not monotonic", "cu past total", "max_seqlen too small", "seqused too long"}


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_rejects(name):
    make_kwargs, exc, needle = VARLEN_CASES[name]
    q, k, v = t(16, 4, 64), t(16, 4, 64), t(16, 4, 64)
    debug = {"debug_checks": True} if name in _VALUE_LIES else {}
    with pytest.raises(exc) as info:
        fa.flash_attn_varlen_func(q, k, v, **make_kwargs(), **debug)
    assert needle in str(info.value), str(info.value)
