"""Compile entry: frozen config -> compiled kernel (fake compile arguments, kernel routing, the in-process cache).

* Kernels are compiled from fake tensors whose batch, lengths, head counts and strides are symbolic, so a new
  sequence length, batch size or model never recompiles; the key is (kernel class, frozen config, target arch).
* ``get_kernel`` looks a key up in memory (every call), and only at the first use of a key in a process in the
  bundle's prebuilt set (``prebuilt.py``, read-only), then in the user's disk cache (``compile_cache.py``), then
  compiles (and writes the disk cache).

CuTe-DSL is imported on first use, never at package import.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from . import compile_cache, prebuilt
from .arguments import ArgRecord
from .config_combine import COMBINE_VEC, CombineKernelConfig
from .config_bwd import (BwdKernelConfig, BwdPreKernelConfig, BwdVRegsKernelConfig, DqConvertKernelConfig,
                         DqKernelConfig)

log = logging.getLogger("flash_attn_4_sm120")

_MEMORY: dict[tuple, object] = {}
_LOCK = threading.Lock()


def target_arch() -> str:
    """The arch CuTe-DSL compiles for: CUTE_DSL_ARCH if set (the compile gate, without a GPU; on a GPU the call
    path checked it against the device first, device.device_caps), else the current device's target from the
    capability table (device.CAPABILITIES; a string for the compiler and the cache key, never compared)."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    from .device import device_caps

    return device_caps(None).arch


def fake_args(record: ArgRecord, cfg) -> tuple:
    """Fake arguments of a kernel, built from its declared record (arguments.py): every batch, length, head
    count and stride symbolic, so one compiled kernel serves every shape of its configuration."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .kernels.fwd_base import DTYPES

    dt = DTYPES.get(getattr(cfg, "dtype", None))
    all_dtypes = {**DTYPES, "fp32": Float32}

    def act(lead_dims: int, last: int, dtype=None):  # (…, last) with last contiguous and 16-byte aligned rows
        dtype = dtype or dt
        shape = tuple(cute.sym_int() for _ in range(lead_dims)) + (last,)
        stride = tuple(cute.sym_int64(divisibility=128 // dtype.width) for _ in range(lead_dims)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)

    def rowstat(rank: int):
        return cute.runtime.make_fake_tensor(
            Float32, tuple(cute.sym_int() for _ in range(rank)),
            stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,), assumed_align=4)

    def rows(rank: int, dtype, last: int):  # (…, last), last contiguous, rows aligned to COMBINE_VEC elements
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (last,)
        stride = tuple(cute.sym_int64(divisibility=COMBINE_VEC) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=COMBINE_VEC * dtype.width // 8)

    def strided(rank: int):
        return cute.runtime.make_fake_tensor(Float32, tuple(cute.sym_int() for _ in range(rank)),
                                             stride=tuple(cute.sym_int64() for _ in range(rank)), assumed_align=4)

    def vec(dtype):
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=4)

    def fake(arg):
        if arg.when is not None and not getattr(cfg, arg.when):
            return None
        varlen = arg.varlen is not None and getattr(cfg, arg.varlen)
        split = arg.split is not None and getattr(cfg, arg.split)  # + a leading num_splits dim, fp32
        if arg.kind == "act":
            return act((2 if varlen else 3) + split, getattr(cfg, arg.dim), Float32 if split else None)
        if arg.kind == "rowstat":
            return rowstat((2 if varlen else 3) + split)
        if arg.kind == "rows":
            return rows(arg.rank, all_dtypes[getattr(cfg, arg.dtype)], getattr(cfg, arg.dim))
        if arg.kind == "strided":
            return strided(arg.rank)
        if arg.kind == "dqacc":  # (blocks, H, tile_m * head_dim), contiguous: 16-byte aligned tiles
            per_tile = cfg.tile_m * cfg.head_dim
            return cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int(), per_tile),
                                                 stride=(cute.sym_int64(), per_tile, 1), assumed_align=16)
        if arg.kind == "i32vec":
            return vec(cutlass.Int32)
        if arg.kind == "i32mat":
            return cute.runtime.make_fake_tensor(
                cutlass.Int32, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1), assumed_align=4)
        if arg.kind == "i64vec":
            return cute.runtime.make_fake_tensor(cutlass.Int64, (1,), stride=(1,), assumed_align=8)
        if arg.kind == "i32nd":  # int32 strides (the host checks the extents), last dim contiguous
            return cute.runtime.make_fake_tensor(
                cutlass.Int32, tuple(cute.sym_int() for _ in range(arg.rank)),
                stride=tuple(cute.sym_int() for _ in range(arg.rank - 1)) + (1,), assumed_align=4)
        if arg.kind == "aux":
            aux_dtypes = {"fp32": Float32, "i32": cutlass.Int32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16,
                          "i64": cutlass.Int64}
            # int32 extents and strides (the host checks numel < 2**31), last dim contiguous: few registers
            return tuple(cute.runtime.make_fake_tensor(
                aux_dtypes[name], tuple(cute.sym_int() for _ in range(rank)),
                stride=tuple(cute.sym_int() for _ in range(rank - 1)) + (1,),
                assumed_align=aux_dtypes[name].width // 8)
                for name, rank in cfg.mods.aux_sig)
        if arg.kind == "record":  # a NamedTuple of its fields (arguments.py says why not a dataclass)
            return arg.record(*map(fake, arg.fields))
        if arg.kind == "f32vec":
            return vec(Float32)
        if arg.kind == "f32":
            return Float32(1.0)
        if arg.kind == "i32":
            return Int32(1)
        raise ValueError(f"{record.kernel}: unknown argument kind {arg.kind!r} of {arg.name!r}")

    out = [fake(arg) for arg in record.args]
    out.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return tuple(out)


def kernel_route(cfg) -> tuple[str, str]:
    """(module under kernels/, class name) of the kernel that serves ``cfg`` (by the config's type and tile; no
    arch comparisons).  Names only: the compile key needs no import of CuTe-DSL, so a prebuilt or cached kernel
    loads without it."""
    if isinstance(cfg, CombineKernelConfig):
        return "combine", "FlashCombine"
    if isinstance(cfg, BwdPreKernelConfig):
        return "bwd_preprocess", "FlashBwdPreprocess"
    if isinstance(cfg, DqConvertKernelConfig):
        return "bwd_dq_convert", "FlashBwdDqConvert"
    if isinstance(cfg, DqKernelConfig):
        return "bwd_dq", "FlashBwdDq"
    if isinstance(cfg, BwdVRegsKernelConfig):
        return "bwd_dkdv_vregs", "FlashBwdDkdvVRegs"
    if isinstance(cfg, BwdKernelConfig):
        return ("bwd_dkdv_kvrows", "FlashBwdDkdvKvRows") if cfg.kv_rows else ("bwd_dkdv", "FlashBwdDkdv")
    if cfg.tile.tma:  # paged too: the dispatcher picks a TMA tile only when page_size % tile_n == 0
        return "fwd_tma", "FlashFwdTma"
    if cfg.tile.kv_groups > 1:  # decode tiles with the keys split between warp groups
        return "fwd_decode", "FlashFwdDecode"
    return "fwd_cpasync", "FlashFwdCpAsync"


def kernel_class(cfg):
    """The kernel class that serves ``cfg`` (imports its module, and so CuTe-DSL)."""
    import importlib

    module, name = kernel_route(cfg)
    return getattr(importlib.import_module(f".kernels.{module}", __package__), name)


def compile_kernel(cfg, with_kernel: bool = False):
    """Compile (no cache) and return the CuTe-DSL compiled function (and the kernel object, whose
    ``launch_smem_bytes`` is set at trace time); runs on a CPU-only machine too."""
    import cutlass.cute as cute

    from dataclasses import replace

    mods = getattr(cfg, "mods", None)
    if mods is not None:
        mods = mods.resolved()  # a library mod named by its recipe (the compile gate's workers) gets its callables
        cfg = replace(cfg, mods=mods)
    kernel = kernel_class(cfg)(cfg)
    if mods is None:
        fn = cute.compile(kernel, *fake_args(kernel.ARGS, cfg), options="--enable-tvm-ffi")
    else:
        try:
            fn = cute.compile(kernel, *fake_args(kernel.ARGS, cfg), options="--enable-tvm-ffi")
        except Exception as exc:  # name the user's mods: the DSL error alone points into this package
            raise ModCompileError(f"{cfg.name()}: the kernel with {mods.names} (aux tensors {mods.aux_sig}) failed "
                                  f"to compile: {type(exc).__name__}: {exc}") from exc
    return (fn, kernel) if with_kernel else fn


class ModCompileError(ValueError):
    """A score_mod / mask_mod / score_mod_bwd that CuTe-DSL could not compile (message names the mods)."""


def kernel_key(cfg) -> tuple:
    """The cache key of ``cfg`` on the current target (the prebuilt manifest and the disk cache use it too)."""
    return (kernel_route(cfg)[1], cfg, target_arch())


def get_kernel(cfg):
    """Compiled kernel for ``cfg`` (a forward, dK/dV, dQ, preprocess or combine config) on the current target: memory,
    then the bundle's prebuilt set, then the disk cache, then compile."""
    return cached_kernel(kernel_key(cfg), cfg, compile_kernel)


def cached_kernel(key: tuple, cfg, compile_fn):
    """The kernel of ``key`` from memory, the prebuilt set, the disk cache, or ``compile_fn(cfg)`` (kernels outside
    ``kernel_route``, such as the FP8 forward, give their own key and compile function)."""
    fn = _MEMORY.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _MEMORY.get(key)
        if fn is not None:
            return fn
        t0 = time.perf_counter()
        mods = getattr(cfg, "mods", None)
        cacheable = mods is None or mods.disk_cacheable  # user mods: memory only
        if cacheable and os.environ.get("FA4_SM120_PREBUILT", "1") != "0":
            fn = prebuilt.load(key, cfg)
        path = compile_cache.entry_path(key) if cacheable and fn is None else None
        if path is not None and not compile_cache.safe_dir(path.parent):
            path = None
        if path is not None:
            fn = compile_cache.load(key, cfg, path)
        if fn is None:
            fn = compile_fn(cfg)
            log.debug("compiled %s in %.3f s", cfg.name(), time.perf_counter() - t0)
            if path is not None:
                compile_cache.store(fn, key, path)
        _MEMORY[key] = fn
        return fn
