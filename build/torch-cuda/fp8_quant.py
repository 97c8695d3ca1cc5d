"""Host helper that quantizes q/k/v to float8_e4m3fn for the FP8 forward (torch ops only).

``quantize_qkv`` returns the e4m3 tensors and their descales in FlashAttention-3's layout: fp32 (B, Hkv), one
value per (batch entry, KV head); the query scale covers the query heads of the KV group (FA3's ``q_descale``).
A value x is stored as ``round_e4m3(x / descale)``, so ``x ~= x8.float() * descale``.

Incoherent processing (``rotate=True``): Q and K are multiplied by the same orthonormal Hadamard matrix H along
the head dimension before quantization.  (Q H)(K H)^T = Q K^T, so the attention is unchanged in exact arithmetic,
while H spreads an outlier entry over the whole row, which shrinks the range a scale must cover and the e4m3
error (FlashAttention-3, section 3.3).  V is not rotated (its rotation would have to be undone on the output).

Granularity: ``"tensor"`` (one scale per tensor, broadcast to (B, Hkv)), ``"head"`` (per (B, Hkv)) -- both are what
the FP8 forward takes -- and ``"block"``: per (B, Hkv, block of ``block_size`` rows) scales for Q and K, returned as
(B, Hkv, ceil(S / block_size)).  The FP8 forward of this release takes (B, Hkv) descales only; ``"block"`` serves
the accuracy study (tests/fp8_emulation.py) and a later kernel that reads block scales.

Everything is torch ops on the inputs' device: no host read of a device value, nothing cached, so the helper can
be captured in a CUDA graph.  NaN in an input gives a NaN descale (it propagates, never hidden); an all-zero
group gets descale 1.0.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
GRANULARITIES = ("tensor", "head", "block")


def hadamard(n: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal (n, n) Hadamard matrix: block diagonal of Sylvester blocks of size p, the largest power of two
    dividing n (p = n for 64, 128, 256; 32 for 96 and 192).  H @ H.T = I and H is symmetric."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"hadamard size must be a positive int, got {n!r}")
    p = n & -n  # largest power of two dividing n
    i = torch.arange(p, device=device)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    for shift in range(max(p.bit_length() - 1, 0)):  # popcount parity of i & j
        parity ^= (bits >> shift) & 1
    block = (1 - 2 * parity).to(dtype) * (p ** -0.5)
    return torch.block_diag(*([block] * (n // p)))


def _check_input(name: str, t, ndim: int = 4) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim) (4-D), got shape {tuple(t.shape)}; "
                         "varlen (total, heads, head_dim) tensors are not supported by quantize_qkv yet")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _descale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # amax = 0 -> 1.0 (any scale reproduces zeros); NaN stays NaN (the comparison is False)
    return torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)


def _quantize_grouped(x: torch.Tensor, hkv: int, granularity: str, block_size: int):
    """x fp32 (B, S, H, D) with H = hkv * group -> (e4m3 tensor, descale)."""
    b, s, h, d = x.shape
    g = x.view(b, s, hkv, h // hkv, d)
    if granularity == "tensor":
        descale = _descale_from_amax(x.abs().amax()).expand(b, hkv).contiguous()
        scale = descale.view(b, 1, hkv, 1, 1)
    elif granularity == "head":
        descale = _descale_from_amax(g.abs().amax(dim=(1, 3, 4)))  # (B, Hkv)
        scale = descale.view(b, 1, hkv, 1, 1)
    else:
        nblk = -(-s // block_size)
        pad = nblk * block_size - s
        gp = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, 0, 0, pad)) if pad else g
        amax = gp.abs().view(b, nblk, block_size, hkv, h // hkv, d).amax(dim=(2, 4, 5))  # (B, nblk, Hkv)
        descale = _descale_from_amax(amax).transpose(1, 2).contiguous()  # (B, Hkv, nblk)
        scale = descale.transpose(1, 2).repeat_interleave(block_size, dim=1)[:, :s].view(b, s, hkv, 1, 1)
    q8 = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(b, s, h, d)
    return q8, descale


def quantize_qkv(q, k, v, *, rotate: bool = False, granularity: str = "head", block_size: int = 128):
    """q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) in fp16/bf16/fp32 ->
    ``(q8, k8, v8, q_descale, k_descale, v_descale)``: e4m3 tensors of the same shapes (contiguous) and fp32
    descales ((B, Hkv); Q and K (B, Hkv, ceil(S / block_size)) with ``granularity="block"``, V stays (B, Hkv)).

    ``rotate=True`` multiplies Q and K by ``hadamard(D)`` first (incoherent processing; the scores are unchanged).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_input(name, t)
    if not isinstance(rotate, bool):
        raise ValueError(f"rotate must be True or False, got {rotate!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "block" and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                   or block_size < 1):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"q/k/v shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(batch of all three and (seqlen, heads) of k and v must match)")
    if k.shape[3] != d:
        raise ValueError(f"k's head_dim {k.shape[3]} must equal q's {d}")
    hkv = k.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k/v's ({hkv})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    qf, kf, vf = q.float(), k.float(), v.float()
    if rotate:
        h = hadamard(d, device=q.device)
        qf, kf = qf @ h, kf @ h
    q8, q_descale = _quantize_grouped(qf, hkv, granularity, block_size)
    k8, k_descale = _quantize_grouped(kf, hkv, granularity, block_size)
    v8, v_descale = _quantize_grouped(vf, hkv, "tensor" if granularity == "tensor" else "head", block_size)
    return q8, k8, v8, q_descale, k_descale, v_descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor, hkv: int | None = None, block_size: int = 128):
    """fp32 values of an e4m3 (B, S, H, D) tensor with its (B, Hkv) or (B, Hkv, nblk) descale."""
    b, s, h, d = x8.shape
    hkv = descale.shape[1] if hkv is None else hkv
    x = x8.float().view(b, s, hkv, h // hkv, d)
    if descale.dim() == 2:
        scale = descale.view(b, 1, hkv, 1, 1)
    else:
        scale = descale.transpose(1, 2).repeat_interleave(block_size, dim=1)[:, :s].view(b, s, hkv, 1, 1)
    return (x * scale).view(b, s, h, d)


def quantize_query(q: torch.Tensor, hkv: int):
    """A bf16/fp16 query (B, Sq, Hq, D) for an e4m3 KV cache -> ``(q8, q_descale)``: q8 e4m3 (B, Sq, Hq, D)
    contiguous, q_descale fp32 (B, Hkv).  ``flash_attn_with_kvcache`` calls it on the device when q is bf16/fp16
    and the cache e4m3 (torch ops only: no host read, capturable in a CUDA graph).

    Why one scale per (batch entry, KV head): that is the finest scale the FP8 kernel applies to q (FlashAttention-
    3's ``q_descale`` layout: the query heads of a KV group share one tile, and so one descale), and the coarsest
    that keeps one sequence's or one head group's large values from crushing another's small ones into e4m3's
    subnormals.  The scale covers every query row (Sq) and head of the group.

    Overflow: descale = amax / 448, so |q / descale| <= 448 (e4m3's largest finite value) up to the rounding of
    that division, which the clamp to [-448, 448] absorbs (a value past 448 would become NaN in
    ``float8_e4m3fn``, not saturate).  A group whose amax is 0 (all-zero rows, e.g. padding) gets descale 1.0
    instead of 0, which would turn its zeros into 0/0 = NaN.  NaN in q gives its group a NaN descale (NaN == 0 is
    false), so NaN propagates to that group's output, never hidden; an inf gives an inf descale, and the group's
    output is NaN as well.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be a bf16/fp16 (batch, seqlen, heads, head_dim) tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(hkv, int) or isinstance(hkv, bool) or hkv < 1 or q.shape[2] % hkv:
        raise ValueError(f"hkv={hkv!r} must be a positive int dividing q's {q.shape[2]} heads")
    if q.numel() == 0:  # no rows to take an amax over (Sq = 0): nothing to scale
        return q.to(torch.float8_e4m3fn).contiguous(), torch.ones(q.shape[0], hkv, device=q.device)
    q8, q_descale = _quantize_grouped(q.float(), hkv, "head", 1)
    return q8.contiguous(), q_descale


def quantize_with_descale(x: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """bf16/fp16/fp32 x (B, S, H, D) and fp32 descale (B, H) -> e4m3 (B, S, H, D) contiguous: x / descale,
    saturated to [-448, 448] (``float8_e4m3fn`` has no inf: past 448 the cast gives NaN), rounded to nearest even.
    What a bf16/fp16 append into an e4m3 cache stores, under the cache's own k_descale / v_descale (the stored value
    times the descale is x, up to e4m3's rounding).  NaN in x or the descale stays NaN; a zero descale saturates
    x != 0 and turns x == 0 into NaN (0 / 0), so it is visible.  Torch ops only (capturable)."""
    b, _, h, _ = x.shape
    return (x.float() / descale.view(b, 1, h, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()


def quantize_query_packed(q: torch.Tensor, hkv: int, cu_seqlens_q: torch.Tensor):
    """``quantize_query`` for packed rows: bf16/fp16 q (total_q, Hq, D) of the sequences ``cu_seqlens_q`` (int32
    (B + 1,)) -> ``(q8 (total_q, Hq, D) contiguous, q_descale (B, Hkv))``, one scale per (sequence, KV head) from
    the amax of that sequence's rows, with the same rules (descale = amax / 448, clamp, 1.0 for an all-zero or
    empty sequence, NaN propagates to its own group).  Each row finds its sequence on the device (a binary search
    of cu_seqlens_q) and the amax is a scatter: no host read of cu_seqlens_q, capturable.  Rows past
    cu_seqlens_q[-1] get a scale of their own (the kernel never reads them)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be a bf16/fp16 (total, heads, head_dim) tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    if not isinstance(hkv, int) or isinstance(hkv, bool) or hkv < 1 or q.shape[1] % hkv:
        raise ValueError(f"hkv={hkv!r} must be a positive int dividing q's {q.shape[1]} heads")
    total, hq, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    g = q.float().view(total, hkv, hq // hkv, d)
    row_amax = g.abs().amax(dim=(2, 3)) if total else g.new_zeros(0, hkv)  # (total, Hkv)
    rows = torch.arange(total, device=q.device, dtype=cu_seqlens_q.dtype)
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), rows, right=True).clamp_(max=batch).long()  # B: the rest
    index = seq[:, None].expand(total, hkv)
    amax = torch.zeros(batch + 1, hkv, device=q.device).scatter_reduce_(0, index, row_amax, "amax")
    # NaN through a scatter's max is backend-defined: count NaN rows per group and put NaN back explicitly
    nans = torch.zeros(batch + 1, hkv, device=q.device).scatter_add_(0, index, row_amax.isnan().float())
    descale_all = _descale_from_amax(amax.masked_fill(nans > 0, float("nan")))  # (B + 1, Hkv)
    q8 = (g / descale_all[seq].view(total, hkv, 1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q8.view(total, hq, d), descale_all[:batch].contiguous()
