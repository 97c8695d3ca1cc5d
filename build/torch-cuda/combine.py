"""Host side of the split-KV combine (kernels/combine.py): validation, output allocation, launch.

``check_combine`` raises ValueError/NotImplementedError before any launch; ``launch_combine`` runs the kernel on
tensors already in the kernel's layout (the split-KV forward calls it directly, after its own checks).  No
device->host synchronisation: only shapes, strides and dtypes are read on the host.
"""

from __future__ import annotations

import torch

from .arguments import COMBINE_ARGS
from .compat import refuse
from .config_combine import (COMBINE_MAX_SPLITS, COMBINE_VEC, CombineKernelConfig, combine_head_dim_problem,
                     combine_split_groups)
from .launch import compiled_kernel as _kernel, launch as _launch, sm_count  # shared with the attention kernels

COMBINE_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MAX_ROWS = (1 << 31) - 1  # rows (batch * seqlen * heads) are indexed in int32
_CONFIGS: dict[tuple, CombineKernelConfig] = {}
# (config, device index) -> compiled kernel, and ("call", partial dtype, out dtype, out shape, splits, has_lse,
# device index) -> the same kernel, so a decode loop's combine launch is one dict lookup (one memo: clearing it
# forgets both)
_KERNELS: dict[tuple, object] = {}
_MAX_CALL_KEYS = 4096


def _fail(msg: str):
    raise ValueError(msg)


def _check_rows(name: str, t: torch.Tensor) -> None:
    """Last dim contiguous, every other stride and the data pointer aligned to the kernel's 4-element vectors."""
    strides = t.stride()
    if strides[-1] != 1:
        _fail(f"{name} must be contiguous in its last dimension (stride(-1) = {strides[-1]}); call .contiguous()")
    elem = t.element_size()
    if t.numel() and (t.data_ptr() % (COMBINE_VEC * elem) or any(s % COMBINE_VEC for s in strides[:-1])):
        _fail(f"{name} rows must be {COMBINE_VEC * elem}-byte aligned (data_ptr % {COMBINE_VEC * elem} == 0 and "
              f"every stride but the last a multiple of {COMBINE_VEC}); got strides {tuple(strides)}, "
              f"data_ptr % {COMBINE_VEC * elem} = {t.data_ptr() % (COMBINE_VEC * elem)}; call .contiguous()")


def check_combine(out_partial, lse_partial, out, out_dtype, return_lse) -> torch.dtype:
    """Validate a ``flash_attn_combine`` call; returns the output dtype."""
    if not isinstance(out_partial, torch.Tensor):
        _fail(f"out_partial must be a torch.Tensor, got {type(out_partial).__name__}")
    if not isinstance(lse_partial, torch.Tensor):
        _fail(f"lse_partial must be a torch.Tensor, got {type(lse_partial).__name__}")
    if out_partial.dim() not in (4, 5):
        _fail("out_partial must be (num_splits, batch, seqlen, nheads, head_dim) or, varlen, (num_splits, total_q, "
              f"nheads, head_dim); got shape {tuple(out_partial.shape)}")
    if out_partial.dtype not in COMBINE_DTYPE_NAMES:
        _fail(f"out_partial has dtype {out_partial.dtype}; supported: torch.float32, torch.bfloat16, torch.float16")
    dev = out_partial.device
    if lse_partial.dtype != torch.float32:
        _fail(f"lse_partial must have dtype torch.float32, got {lse_partial.dtype}")
    if lse_partial.device != dev:
        _fail(f"lse_partial is on {lse_partial.device} but out_partial is on {dev}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        _fail(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without head_dim), "
              f"got {tuple(lse_partial.shape)}")
    num_splits, d = out_partial.shape[0], out_partial.shape[-1]
    if not 1 <= num_splits <= COMBINE_MAX_SPLITS:
        _fail(f"num_splits (out_partial.shape[0]) = {num_splits} must be in [1, {COMBINE_MAX_SPLITS}]")
    problem = combine_head_dim_problem(d)
    if problem:
        _fail(f"out_partial: {problem}")
    rows = 1
    for n in out_partial.shape[1:-1]:
        rows *= n
    if rows > _MAX_ROWS:
        _fail(f"out_partial has {rows} rows (batch * seqlen * nheads) > the supported maximum {_MAX_ROWS}; "
              "combine in several calls")
    _check_rows("out_partial", out_partial)
    if out_dtype is not None and out_dtype not in COMBINE_DTYPE_NAMES:
        _fail(f"out_dtype={out_dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if tuple(out.shape) != tuple(out_partial.shape[1:]):
            _fail(f"out must have shape {tuple(out_partial.shape[1:])}, got {tuple(out.shape)}")
        if out.dtype not in COMBINE_DTYPE_NAMES:
            _fail(f"out has dtype {out.dtype}; supported: torch.float32, torch.bfloat16, torch.float16")
        if out_dtype is not None and out.dtype != out_dtype:
            _fail(f"out has dtype {out.dtype} but out_dtype={out_dtype}; pass one of them, or make them agree")
        if out.device != dev:
            _fail(f"out is on {out.device} but out_partial is on {dev}")
        _check_rows("out", out)
    if not isinstance(return_lse, bool):
        _fail(f"return_lse must be True or False, got {return_lse!r}")
    if torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad):
        refuse("combine_grad")
    if not out_partial.is_cuda:  # last, so the checks above run (and are tested) on CPU tensors too
        _fail(f"out_partial is on {out_partial.device}; flash-attn-4-sm120 needs CUDA tensors")
    if out is not None:
        return out.dtype
    return out_partial.dtype if out_dtype is None else out_dtype


def combine_config(partial_dtype: torch.dtype, out_dtype: torch.dtype, d: int, has_lse: bool,
                   split_groups: int = 1) -> CombineKernelConfig:
    key = (partial_dtype, out_dtype, d, has_lse, split_groups)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = CombineKernelConfig(COMBINE_DTYPE_NAMES[partial_dtype], COMBINE_DTYPE_NAMES[out_dtype],
                                                  d, has_lse, split_groups)
    return cfg


def launch_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None) -> None:
    """Run the combine kernel on (splits, B, S, H, D) / (splits, B, S, H) partials into (B, S, H, D) / (B, S, H)
    outputs (lse may be None).  No checks: callers validated."""
    shape = out.shape
    dv = shape[-1]
    num_rows = out.numel() // dv if dv else 0
    if num_rows == 0:
        return
    dev = out.device
    call = ("call", out_partial.dtype, out.dtype, shape, out_partial.shape[0], lse is not None, dev.index)
    fn = _KERNELS.get(call)
    if fn is None:
        groups = combine_split_groups(num_rows, out_partial.shape[0], dv, sm_count(dev))
        cfg = combine_config(out_partial.dtype, out.dtype, dv, lse is not None, groups)
        fn = _KERNELS.get((cfg, dev.index))
        if fn is None:
            fn = _KERNELS[(cfg, dev.index)] = _kernel(cfg, dev)
        if len(_KERNELS) >= _MAX_CALL_KEYS:  # many shapes (varlen totals): keep the compiled kernels only
            for k in [k for k in _KERNELS if k[0] == "call"]:
                del _KERNELS[k]
        _KERNELS[call] = fn
    _launch(fn, COMBINE_ARGS, dev, dict(out_partial=out_partial, lse_partial=lse_partial, out=out, lse=lse,
                                        num_rows=num_rows))


def run_combine(out_partial, lse_partial, out=None, out_dtype=None, return_lse=True):
    """``flash_attn_combine`` after its keyword checks: validate, allocate, launch; returns (out, lse)."""
    dtype = check_combine(out_partial, lse_partial, out, out_dtype, return_lse)
    varlen = out_partial.dim() == 4
    dev = out_partial.device
    from .device import device_caps, split_problem

    problem = split_problem(device_caps(dev))  # before anything compiles
    if problem:
        raise ValueError(f"flash_attn_combine: {problem}")
    if out is None:
        out = torch.empty(out_partial.shape[1:], dtype=dtype, device=dev)
    lse = None
    if return_lse:  # flash-attn-4's layout: (B, S, H) / (total_q, H) views with the sequence contiguous
        if varlen:
            lse = torch.empty((out_partial.shape[2], out_partial.shape[1]), dtype=torch.float32, device=dev).t()
        else:
            b, s, h = out_partial.shape[1:4]
            lse = torch.empty((b, h, s), dtype=torch.float32, device=dev).transpose(1, 2)
    if out_partial.requires_grad or lse_partial.requires_grad:  # grad mode is off here (check_combine)
        out_partial, lse_partial = out_partial.detach(), lse_partial.detach()
    if varlen:
        launch_combine(out_partial.unsqueeze(1), lse_partial.unsqueeze(1), out.unsqueeze(0),
                       None if lse is None else lse.unsqueeze(0))
    else:
        launch_combine(out_partial, lse_partial, out, lse)
    return out, lse
