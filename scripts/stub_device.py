"""One device stub for the CPU harnesses: the package's public calls run on CPU tensors as on a GPU of a given
capability and SM count, with the compiler and the launches replaced by the caller's recorders.

Users: ``scripts/prebuilt_set.py`` (which compile keys the calls select), ``tests/plan_grid.py`` (which configs and
launch geometry the calls select) and ``benchmarks/bench_host.py --cpu`` (host cost with the launches stubbed).

The stub rebinds, in every loaded module of the package, each name bound to one of these functions (whatever name a
module imported it under, so the harness does not depend on which module holds the launch sequence):

- ``device.device_caps``  -> the capability record of the device asked for;
- ``launch.sm_count``     -> its SM count;
- ``launch.compiled_kernel`` -> ``compile(cfg, dev)`` of the caller (nothing compiles);
- ``launch.launch``       -> ``launch(fn, record, dev, values)`` of the caller (nothing runs);
- ``validate.check_tensor`` -> every check but the CUDA placement (a CPU tensor passes as if on the GPU).

The caches that hold compiled kernels (the backward's preprocess/fused kernels, the combine kernels) and the
memoised tile choices are cleared before and after, so no stand-in outlives the stub and no real kernel leaks in.
``pkg`` names the package: a renamed copy (``flash_attn_4_sm120_base``) is stubbed the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

PKG = "flash_attn_4_sm120"


def _rebind(pkg: str, original, replacement, undo: list) -> None:
    """Point every name bound to ``original`` in the package's modules (kernels included) at ``replacement``."""
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == pkg or name.startswith(pkg + ".")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                undo.append((mod, attr, value))
                setattr(mod, attr, replacement)


def _clear(pkg: str) -> None:
    """Forget memoised tiles and every compiled kernel a module keeps (older copies lack some of the hooks)."""
    importlib.import_module(pkg + ".config").clear_caches()
    bwd = importlib.import_module(pkg + ".dispatch_bwd")
    if hasattr(bwd, "clear_caches"):
        bwd.clear_caches()
    combine = importlib.import_module(pkg + ".combine")
    for cache in ("_KERNELS", "_CONFIGS"):
        if isinstance(getattr(combine, cache, None), dict):
            getattr(combine, cache).clear()


@contextlib.contextmanager
def stubbed_device(name: str, capability: tuple[int, int], num_sms: int, compile, launch, pkg: str = PKG):
    """Within the block, calls of ``pkg`` on CPU tensors plan as on device ``name`` (``capability``, ``num_sms``);
    ``compile(cfg, dev)`` stands for the compiler and ``launch(fn, record, dev, values)`` for the launch."""
    import torch

    importlib.import_module(pkg)  # loads the package's modules, so every binding is rebound
    device = importlib.import_module(pkg + ".device")
    launch_mod = importlib.import_module(pkg + ".launch")
    validate = importlib.import_module(pkg + ".validate")

    class _OnCuda(torch.Tensor):  # a CPU tensor that validate.check_tensor sees as placed on the GPU
        is_cuda = True
        # plain tensor methods, without the Python __torch_function__ dispatch of a subclass: the check costs ~5 µs
        # per tensor instead of ~35 (it runs in every call of bench_host_ab --cpu, on both sides)
        __torch_function__ = torch._C._disabled_torch_function_impl

    caps = device.caps_from_properties(name, *capability, None, None, num_sms)
    real_check = validate.check_tensor

    def check_tensor(tname, t, rank, dev=None):  # every check but the CUDA placement
        real_check(tname, t.as_subclass(_OnCuda) if isinstance(t, torch.Tensor) else t, rank, None)

    undo: list = []
    _rebind(pkg, device.device_caps, lambda dev=None: caps, undo)
    _rebind(pkg, launch_mod.sm_count, lambda dev: num_sms, undo)
    _rebind(pkg, launch_mod.compiled_kernel, compile, undo)
    _rebind(pkg, launch_mod.launch, launch, undo)
    _rebind(pkg, real_check, check_tensor, undo)
    _clear(pkg)
    try:
        yield
    finally:
        for mod, attr, value in reversed(undo):
            setattr(mod, attr, value)
        _clear(pkg)
