"""FP8 (e4m3) forward: validate -> select config -> compiled kernel -> launch (kernels/fwd_fp8.py).

FlashAttention-3's API: q/k/v ``torch.float8_e4m3fn`` (B, S, H, D) with ``q_descale``/``k_descale``/``v_descale``
fp32 (B, Hkv) (a missing one means 1.0), output bf16 (default) or fp16.  Inference only: a call that needs grad
raises before anything launches, and so does every feature the FP8 kernel does not serve yet (dropout, mods,
block sparsity).  Causal, sliding window, softcap (``fp8_scales``), learnable sink, packed GQA (``pack_gqa``, the
bf16 rule) and split-KV (``num_splits``, the bf16 rule; fp32 partials and splitkv's combine) are served, dense
(``flash_attn_func``), varlen (``flash_attn_varlen_func``: cu_seqlens_q/k, seqused_k) and over a contiguous or
paged KV cache (``flash_attn_with_kvcache``: cache_seqlens, page_table, e4m3 or quantized bf16/fp16 appends);
the last two also take a bf16/fp16 q over e4m3 K/V (an FP8 KV cache), quantized on the device
(``check_fp8_call(query_quantized_here=True)`` lets it through); dispatch_fp8_varlen.py maps them onto the kernel's packed-rows form, and a dense call that packs
or splits runs there too.  No host read of a device value (but a varlen call's missing max_seqlen_q, read once as
the bf16 path does).
"""

from __future__ import annotations

import math

import torch

from . import compat
from .config_fp8 import FP8_HEAD_DIMS, Fp8FwdConfig, select_config

FP8_DTYPES = (torch.float8_e4m3fn,)
_OUT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# the kernel's q_dtype (config_fp8.FP8_Q_DTYPES): a bf16/fp16 q is quantized per tile row in the kernel
_Q_DTYPE = {torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16", torch.float16: "fp16"}
LOG2_E = math.log2(math.e)


FP8_ANY = frozenset((torch.float8_e4m3fn, torch.float8_e5m2))  # any float8 input routes to the FP8 entry


def is_fp8(*tensors) -> bool:
    # every dense call asks this: a loop, not a generator (the generator was 74 bytecodes a call, the loop ~50;
    # benchmarks/results/host_ab_count_cpu.jsonl, from benchmarks/bench_host_ab.py --cpu --count)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype in FP8_ANY:
            return True
    return False


def _check_descale(name, d, b, hkv, device):
    if d is None:
        from .fp8_rows import unit_descale

        return unit_descale(b, hkv, device)
    if not isinstance(d, torch.Tensor):
        raise ValueError(f"{name} must be an fp32 tensor of shape ({b}, {hkv}) (batch, KV heads), got "
                         f"{type(d).__name__}")
    if d.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {d.dtype}")
    if tuple(d.shape) != (b, hkv):
        raise ValueError(f"{name} must have shape (batch, KV heads) = ({b}, {hkv}), got {tuple(d.shape)}")
    if d.device != device:
        raise ValueError(f"{name} is on {d.device}, q on {device}: put it on q's device")
    return d.contiguous()  # an expanded (stride-0) descale gets its own (B, Hkv) copy: the kernel reads rows


def check_fp8_call(q, k, v, *, q_descale, k_descale, v_descale, out_dtype, needs_grad, unsupported: dict,
                   varlen_q=False, varlen_k=False, batch=None, query_quantized_here=False, paged=False):
    """ValueError / NotImplementedError for anything the FP8 forward does not serve; returns (descales, out_dtype
    name).  ``unsupported``: name -> True for each non-default feature argument of the call.  ``varlen_q/k``: q or
    k/v are packed rows (total, H, D) of ``batch`` sequences (else (B, S, H, D)).  ``query_quantized_here``: q may
    be bf16/fp16 (an e4m3 KV cache's query, which the caller quantizes into a fresh contiguous tensor: its layout is
    not checked, a given q_descale is refused, and out_dtype defaults to q's dtype).  ``paged``: k/v are page pools
    (num_pages, page_size, Hkv, D) (their leading dim is not the batch; the page table is checked by the caller)."""
    compat.check_fp8(compiling=False, needs_grad=needs_grad, unsupported={})  # before the dtypes, as before
    hp_q = query_quantized_here and isinstance(q, torch.Tensor) and q.dtype in _OUT
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype == torch.float8_e5m2:
            raise NotImplementedError(f"{name} is float8_e5m2: the FP8 forward serves float8_e4m3fn only; convert "
                                      "with fp8_quant.quantize_qkv")
        if t.dtype != torch.float8_e4m3fn and not (name == "q" and hp_q):
            raise ValueError(
                f"{name} is {t.dtype}: FP8 attention takes float8_e4m3fn k, v and q, or a bf16/fp16 query over "
                "e4m3 K/V in flash_attn_with_kvcache and flash_attn_varlen_func, which quantize it (flash_attn_func "
                "takes an e4m3 q: fp8_quant.quantize_qkv). An e4m3 q over a bf16/fp16 cache is not served: "
                "quantize the cache or give a bf16/fp16 q")
    if hp_q and q_descale is not None:
        raise ValueError(f"q_descale given with a {q.dtype} q: a bf16/fp16 query over an e4m3 cache is quantized "
                         "here, with its own per-(batch, KV head) scale, so a q_descale has no meaning; drop it (or "
                         "pass an e4m3 q with its q_descale)")
    compat.check_fp8(compiling=False, needs_grad=False, unsupported=unsupported)
    for name, t, packed in (("q", q, varlen_q), ("k", k, varlen_k), ("v", v, varlen_k)):
        if name == "q" and hp_q:  # quantized into a fresh contiguous tensor: only its rank matters here
            if t.dim() != (3 if packed else 4):
                raise ValueError(f"q has shape {tuple(t.shape)}: a bf16/fp16 query over e4m3 K/V is "
                                 + ("packed (total, heads, head_dim) rows with cu_seqlens_q" if packed else
                                    "(batch, seqlen, heads, head_dim)"))
            continue
        if t.dim() != (3 if packed else 4):
            raise NotImplementedError(
                f"{name} has shape {tuple(t.shape)}: the FP8 forward takes "
                + ("packed (total, heads, head_dim) rows with cu_seqlens" if packed else
                   "dense (batch, seqlen, heads, head_dim) tensors here (packed rows: flash_attn_varlen_func with "
                   "cu_seqlens; paged K/V: flash_attn_with_kvcache with page_table)"))
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {t.stride()}")
        if any((s % 16) for s in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"{name}'s rows must be 16-byte aligned (strides {t.stride()}, a multiple of 16 "
                             "elements): use .contiguous()")
        if t.stride(-3) >= 2 ** 31:  # the kernel keeps K/V row strides in 32 bits
            raise ValueError(f"{name}'s sequence stride {t.stride(-3)} must be below 2**31 elements: use "
                             ".contiguous()")
    b = q.shape[0] if batch is None else batch
    hq, d = q.shape[-2:]
    hkv, dv = v.shape[-2:]
    if (tuple(k.shape[:-1]) != tuple(v.shape[:-1]) or k.shape[-1] != d or (not varlen_q and q.shape[0] != b)
            or (not varlen_k and not paged and k.shape[0] != b)):
        raise ValueError(f"q/k/v shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                         + (f" (batch {b})" if batch is not None else ""))
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k/v's ({hkv})")
    if d not in FP8_HEAD_DIMS or dv != d:
        raise ValueError(f"head dims (d={d}, dv={dv}) are not served by the FP8 forward (served: d = dv in "
                         f"{FP8_HEAD_DIMS})")
    out_dtype = (q.dtype if hp_q else torch.bfloat16) if out_dtype is None else out_dtype
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    # a bf16/fp16 q has no q_descale (refused above): its entry is None, replaced where q is quantized
    descales = ((None if hp_q else _check_descale("q_descale", q_descale, b, hkv, q.device)),
                _check_descale("k_descale", k_descale, b, hkv, q.device),
                _check_descale("v_descale", v_descale, b, hkv, q.device))
    require_cuda(q, k, v)
    return descales, _OUT[out_dtype], out_dtype


def require_cuda(q, k, v) -> None:
    """The device check, last of the host checks (the CPU tests of the routing stub it)."""
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.is_cuda:
        raise ValueError(f"FP8 attention needs CUDA tensors, got device {q.device}")


def fake_args(cfg: Fp8FwdConfig) -> tuple:
    """Symbolic arguments of the FP8 kernel (batch, lengths, heads, strides dynamic), in ``FlashFwdFp8.ARG_NAMES``
    order plus the stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    out_dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}[cfg.out_dtype]  # fp32: split

    def act(dtype, last):
        return cute.runtime.make_fake_tensor(
            dtype, tuple(cute.sym_int() for _ in range(3)) + (last,),
            stride=tuple(cute.sym_int64(divisibility=128 // dtype.width) for _ in range(3)) + (1,), assumed_align=16)

    def f32(rank):
        return cute.runtime.make_fake_tensor(Float32, tuple(cute.sym_int() for _ in range(rank)),
                                             stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
                                             assumed_align=4)

    def i32():
        return cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)

    u8 = cutlass.Uint8
    q_dt = {"e4m3": u8, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[cfg.q_dtype]  # bf16/fp16: no q_descale
    q_descale = f32(2) if cfg.q_dtype == "e4m3" else None
    sink = f32(1) if cfg.has_sink else None
    lens = (i32(), i32(), i32()) if cfg.varlen else (None, None, None)
    table = None
    if cfg.paged:  # (B, max_pages) int32, rows of any stride; the kernel reads no cu_seqlens_k
        lens = (lens[0], None, lens[2])
        table = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                                              assumed_align=4)
    return (act(q_dt, cfg.head_dim), act(u8, cfg.head_dim), act(u8, cfg.head_dim_v), act(out_dt, cfg.head_dim_v),
            f32(3), q_descale, f32(2), f32(2), sink, *lens, table, Float32(1.0), Float32(1.0), Int32(0), Int32(0),
            Int32(1), Int32(1),
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_fp8(cfg: Fp8FwdConfig, with_kernel: bool = False):
    """Compile (no cache); on a CPU-only machine too (CUTE_DSL_ARCH=sm_120a)."""
    import cutlass.cute as cute

    from .kernels.fwd_fp8 import FlashFwdFp8

    kernel = FlashFwdFp8(cfg)
    fn = cute.compile(kernel, *fake_args(cfg), options="--enable-tvm-ffi")
    return (fn, kernel) if with_kernel else fn


def get_fp8_kernel(cfg: Fp8FwdConfig, device: torch.device):
    from .jit import cached_kernel, target_arch

    with torch.cuda.device(device):
        return cached_kernel(("FlashFwdFp8", cfg, target_arch()), cfg, compile_fp8)


def window_bounds(window_size, causal: bool, sq: int, sk: int):
    """(local, left, right) for the kernel: FlashAttention's rule (causal fixes right = 0; None or a negative side
    is unbounded), an unbounded side given as a bound that covers every key (left = sk, right = sq)."""
    if window_size is None:
        window_size = (None, None)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    for w in window_size:
        if w is not None and (not isinstance(w, int) or isinstance(w, bool)):
            raise ValueError(f"window_size entries must be ints or None, got {window_size!r}")
    left, right = (None if w is None or w < 0 else w for w in window_size)
    if causal:
        right = 0
    local = left is not None or (right is not None and not causal)
    return local, (sk if left is None else min(left, sk)), (sq if right is None else min(right, sq))


def _sink(learnable_sink, hq, device):
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, torch.Tensor) or tuple(learnable_sink.shape) != (hq,):
        raise ValueError(f"learnable_sink must be a tensor of shape (Hq,) = ({hq},), got "
                         f"{tuple(getattr(learnable_sink, 'shape', ())) or type(learnable_sink).__name__}")
    if learnable_sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"learnable_sink must be float32, bfloat16 or float16, got {learnable_sink.dtype}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device}, q on {device}")
    return learnable_sink.float().contiguous()


def fp8_scales(softmax_scale, softcap, head_dim: int) -> tuple[bool, float, float]:
    """(softcap on, scale_log2, softcap_log2) of the kernel (FlashFwdFp8.ARG_NAMES): without softcap
    softmax_scale · log2(e) and an unused 1.0; with one, tanh's argument in exp2 units 2 · log2(e) ·
    softmax_scale / cap and cap · log2(e) (kernels/fwd_fp8.py softcap_scores).  The descales multiply the first
    in the kernel.  ``softcap``: None or 0 is off; validate.check_scalars names a bad value (negative, not
    finite, overflowing fp32 with the scale), the bf16 path's check."""
    from .validate import check_scalars

    if softcap is None or (softcap.__class__ in (int, float) and softcap == 0):  # the common call: no softcap
        scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        return False, scale * LOG2_E, 1.0
    scale, cap = check_scalars(softmax_scale, softcap, head_dim)
    if cap == 0:
        return False, scale * LOG2_E, 1.0
    if not 2 * LOG2_E * scale / cap < 3.4e38:  # the doubled argument of tanh overflows fp32
        raise ValueError(f"softmax_scale={scale} with softcap={cap} overflows fp32 in the FP8 kernel "
                         "(2 * log2(e) * softmax_scale / softcap must stay below 3.4e38)")
    return True, 2 * LOG2_E * scale / cap, cap * LOG2_E


def run_fp8_forward(q, k, v, descales, *, softmax_scale, causal, out_name, out_dtype, window_size=None,
                    learnable_sink=None, softcap=0.0):
    """Launch the FP8 forward on checked inputs -> (out (B, Sq, Hq, Dv), lse fp32 (B, Hq, Sq))."""
    from .config_fp8 import check_target
    from .device import device_caps

    caps = device_caps(q.device)  # ValueError for a device the bundle does not serve, before any compile
    check_target(caps.arch, caps.describe())
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    capped, scale_log2, cap_log2 = fp8_scales(softmax_scale, softcap, d)
    local, left, right = window_bounds(window_size, causal, q.shape[1], k.shape[1])
    sink = _sink(learnable_sink, hq, q.device)
    cfg = select_config(d, v.shape[3], causal, out_name, local=local, has_sink=sink is not None, softcap=capped)
    out = torch.empty(b, sq, hq, v.shape[3], dtype=out_dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:  # no keys: O = 0, LSE = -inf, or the sink's logit
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink.view(1, hq, 1).expand(b, hq, sq))
        return out, lse
    fn = get_fp8_kernel(cfg, q.device)
    num_m_blocks = (sq + cfg.tile_m - 1) // cfg.tile_m
    qd, kd, vd = descales
    with torch.cuda.device(q.device):
        fn(q.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8), out, lse, qd, kd, vd, sink, None, None,
           None, None, scale_log2, cap_log2, left, right, hq // hkv, num_m_blocks)
    return out, lse


def fp8_pack(pack_gqa, hq: int, hkv: int, max_seqlen_q: int) -> int:
    """Query heads per packed tile row group: the bf16 path's rule (plan.choose_pack: None packs a KV group when a
    sequence alone fills less than half a tile; True always, False never) on the FP8 tile."""
    from .config_fp8 import FP8_TILE_M
    from .plan import choose_pack

    return choose_pack(pack_gqa, hq // hkv, max_seqlen_q, FP8_TILE_M)


def fp8_splits(num_splits: int, *, batch: int, ctas: int, max_seqlen_k: int, dv: int, device, caps,
               num_warps: int = 4, kv_warps: int = 1) -> int:
    """The split count of an FP8 call: N > 1 exactly N and 1 none (splitkv.resolve_num_splits' checks), <= 0
    automatic (splitkv.auto_num_splits) on the FP8 kernel's KV tile.  The automatic count reads the grid in CTAs of
    four 16-row blocks, the size the rule was tuned on: ``ctas`` decode CTAs (one row block, ``num_warps`` /
    ``kv_warps`` = 1) count a quarter each, so a decode grid is split until it holds about four of them per SM,
    whatever warps split their keys (one warp alone cannot keep its SM's loads in flight; two key-split warps walk
    a CTA's range in about half the time, so the same split count puts twice the warps on each SM)."""
    from .config_fp8 import FP8_NUM_WARPS, FP8_TILE_N
    from .splitkv import resolve_num_splits

    return resolve_num_splits(num_splits, needs_grad=False, batch=batch,
                              ctas=max(1, ctas * (num_warps // kv_warps) // FP8_NUM_WARPS),
                              n_blocks=-(-max(max_seqlen_k, 0) // FP8_TILE_N), dv=dv, device=device, caps=caps)


def run_fp8_packed(q, k, v, cu_q, cu_k, used_k, max_seqlen_q: int, descales, *, softmax_scale, causal, out_name,
                   out_dtype, window_size=None, learnable_sink=None, pack_gqa=None, num_splits: int = 1,
                   max_seqlen_k: int | None = None, rows_covered: bool = True, page_table=None, softcap=0.0):
    """Launch the FP8 forward on checked packed rows: q (1, total_q, Hq, D), k/v (1, total_k, Hkv, D), sequence b
    = q rows cu_q[b]..cu_q[b+1], keys cu_k[b]..cu_k[b]+used_k[b] (int32 on q's device) -> (out (1, total_q, Hq,
    Dv), lse fp32 (1, Hq, total_q)).  ``pack_gqa``: fp8_pack's rule; ``num_splits``: already defaulted by the
    entry point (fp8_splits resolves <= 0 from the grid); ``max_seqlen_k``: the longest sequence's keys (an upper
    bound from shapes, never a device value; default total_k); ``rows_covered``: every q row lies in a sequence
    (else the split partials' LSE starts at -inf so uncovered rows combine to O = 0, LSE = -inf); ``page_table``
    (B, max_pages) int32: k/v are page pools (num_pages, page_size, Hkv, D), sequence b has used_k[b] keys
    through its row of the table (cu_k unused: None), at most max_pages * page_size (the kernel's paged form).
    A bf16/fp16 ``q`` (16-byte aligned rows, out_dtype its own dtype) is quantized per tile row by the kernel
    (``q_dtype``); its descale entry is then None."""
    from .config_fp8 import check_target
    from .device import device_caps

    caps = device_caps(q.device)
    check_target(caps.arch, caps.describe())
    total_q, hq, d = q.shape[1:]
    total_k, hkv = k.shape[1:3]
    paged = page_table is not None
    if paged:  # the keys a sequence can hold (window bounds and the split count read it as total_k)
        total_k = page_table.shape[1] * k.shape[1]
    batch = cu_q.shape[0] - 1
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    capped, scale_log2, cap_log2 = fp8_scales(softmax_scale, softcap, d)
    # bounds that cover every key of any sequence stand for an unbounded side
    local, left, right = window_bounds(window_size, causal, total_q, total_k)
    sink = _sink(learnable_sink, hq, q.device)
    pack = fp8_pack(pack_gqa, hq, hkv, max_seqlen_q) if hkv else 1
    out = torch.empty(1, total_q, hq, v.shape[3], dtype=out_dtype, device=q.device)
    lse = torch.empty(1, hq, total_q, dtype=torch.float32, device=q.device)
    rows = max_seqlen_q * pack
    q_dtype = _Q_DTYPE[q.dtype]
    cfg = select_config(d, v.shape[3], causal, out_name, local=local, has_sink=sink is not None, varlen=True,
                        pack_gqa=pack > 1, rows=rows, paged=paged, q_dtype=q_dtype, softcap=capped)
    if batch == 0 or total_q == 0 or hq == 0:
        return out, lse
    if total_k == 0:  # no keys anywhere: O = 0, LSE = -inf, or the sink's logit
        out.zero_()
        if sink is None:
            lse.fill_(-math.inf)
        else:
            lse.copy_(sink.view(1, hq, 1).expand(1, hq, total_q))
        return out, lse
    num_m_blocks = (rows + cfg.tile_m - 1) // cfg.tile_m
    if num_m_blocks == 0:
        return out, lse
    splits = fp8_splits(num_splits, batch=batch, ctas=num_m_blocks * (hq // pack) * batch,
                        max_seqlen_k=total_k if max_seqlen_k is None else min(max_seqlen_k, total_k),
                        dv=v.shape[3], device=q.device, caps=caps, num_warps=cfg.num_warps,
                        kv_warps=cfg.kv_warps)
    qd, kd, vd = descales
    args = (q.view(torch.uint8) if q_dtype == "e4m3" else q, k.view(torch.uint8), v.view(torch.uint8))
    tail = (qd, kd, vd, sink, cu_q, None if paged else cu_k, used_k, page_table, scale_log2, cap_log2, left, right,
            hq // hkv, num_m_blocks)
    if splits == 1:
        fn = get_fp8_kernel(cfg, q.device)
        with torch.cuda.device(q.device):
            fn(*args, out, lse, *tail)
        return out, lse
    from .splitkv import combine_into, partials

    fn = get_fp8_kernel(select_config(d, v.shape[3], causal, out_name, local=local, has_sink=sink is not None,
                                      varlen=True, pack_gqa=pack > 1, split=True, rows=rows, paged=paged,
                                      q_dtype=q_dtype, softcap=capped), q.device)
    o_part, l_part, o_comb, l_comb = partials(out, lse, splits)  # (splits, 1, total_q, Hq, Dv), (splits, 1, Hq, .)
    if not rows_covered:
        l_part.fill_(-math.inf)
    with torch.cuda.device(q.device):
        fn(*args, o_part[:, 0], l_part[:, 0], *tail)  # the packed-rows form's one batch: the split is the batch
        combine_into(o_comb, l_comb, out, lse, False)
    return out, lse


def default_splits(num_splits, q, k, *, causal, window_size, cu_seqlens_k=None, max_seqlen_k=None,
                   page_table=None) -> int:
    """The bf16 path's ``num_splits`` rule for an FP8 call (always inference): None -> splitkv.default_for_call
    (automatic only for a KV walk of at least AUTO_MIN_KEYS keys, never for a graph capture with a caller-given
    max_seqlen_k), an int as given (0 or less: automatic; checked by splitkv.check_num_splits)."""
    from . import splitkv as SK

    if num_splits is None:
        kw = dict(causal=causal, window_size=window_size, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                  page_table=page_table)  # paged: the walk is the table's capacity (splitkv.default_kv_walk)
        return SK.default_for_call(q, k, kw, 0.0, False, False, False)
    return SK.check_num_splits(num_splits)


def _rows_view_ok(t) -> bool:
    b, s = t.shape[:2]
    return b <= 1 or s == 0 or t.stride(0) == s * t.stride(1)


def fp8_attention(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, out_dtype=None, softmax_scale=None,
                  causal=False, window_size=None, return_lse=False, learnable_sink=None,
                  unsupported: dict | None = None, num_splits=None, pack_gqa=None, softcap=0.0):
    """The FP8 branch of ``flash_attn_func``: checks everything before launch -> (out, lse or None).  A call that
    packs GQA or may split (``fp8_pack`` / ``default_splits``) runs on the packed-rows form (dense q/k/v read as
    one batch of rows, a view; the kernel's varlen configurations carry both)."""
    needs_grad = entry_checks(q, k, v, q_descale, k_descale, v_descale, out_dtype, learnable_sink)
    unsupported = dict(unsupported or {})
    descales, out_name, out_torch = check_fp8_call(q, k, v, q_descale=q_descale, k_descale=k_descale,
                                                   v_descale=v_descale, out_dtype=out_dtype, needs_grad=needs_grad,
                                                   unsupported=unsupported)
    fp8_scales(softmax_scale, softcap, q.shape[-1])  # names a bad softcap before any work
    splits = default_splits(num_splits, q, k, causal=causal, window_size=window_size)
    pack = fp8_pack(pack_gqa, q.shape[2], k.shape[2], q.shape[1])
    if pack > 1 or splits != 1:
        if _rows_view_ok(k) and _rows_view_ok(v):
            from . import fp8_rows as R

            b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            out, lse = run_fp8_packed(
                R.flatten_q(q), R.flatten(k, "k"), R.flatten(v, "v"), R.dense_cu(b, sq, q.device),
                R.dense_cu(b, sk, q.device), R.uniform_lengths(b, sk, q.device), sq, descales,
                softmax_scale=softmax_scale, causal=causal, out_name=out_name, out_dtype=out_torch,
                window_size=window_size, learnable_sink=learnable_sink, pack_gqa=pack_gqa, num_splits=splits,
                max_seqlen_k=sk, rows_covered=True, softcap=softcap)
            return R.unpack(out, lse, b, sq, True, return_lse)
        if splits > 1:  # an explicit split over K/V whose batch stride is not seqlen x row stride
            compat.refuse("fp8_unserved", feature=f"num_splits={splits} with k/v strides {k.stride()} / "
                          f"{v.stride()} (split-KV reads them as packed rows: use .contiguous())")
    out, lse = run_fp8_forward(q, k, v, descales, softmax_scale=softmax_scale, causal=causal, out_name=out_name,
                               out_dtype=out_torch, window_size=window_size, learnable_sink=learnable_sink,
                               softcap=softcap)
    return out, (lse if return_lse else None)


def entry_checks(q, k, v, q_descale, k_descale, v_descale, out_dtype, learnable_sink, *extra) -> bool:
    """The checks every FP8 entry point makes first; returns whether the call needs grad."""
    if not is_fp8(q, k, v, *extra):
        given = [n for n, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale),
                                ("out_dtype", out_dtype)) if x is not None]
        raise ValueError(f"{', '.join(given)} given with {getattr(q, 'dtype', type(q).__name__)} inputs: descales "
                         "and out_dtype apply to float8_e4m3fn q/k/v only; drop them or quantize the inputs "
                         "(fp8_quant.quantize_qkv)")
    compat.check_fp8(compiling=torch.compiler.is_compiling(), needs_grad=False, unsupported={})
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False)
                                           for t in (q, k, v, learnable_sink, *extra))


def fp8_unsupported(*, dropout_p, softcap=0.0, num_splits=None, pack_gqa=None, **optional) -> dict:
    """name -> True for each argument of an FP8 call that the FP8 forward does not serve (non-default value).
    ``softcap``, ``num_splits`` and ``pack_gqa`` are served (the entry points take them: ``fp8_scales`` /
    ``default_splits`` / ``fp8_pack``, which name a bad value) and never listed; they are accepted here so a
    caller may pass its whole call."""
    out = {
        f"dropout_p={dropout_p!r}": dropout_p != 0,
    }
    out.update({name: value is not None for name, value in optional.items()})
    return out
