"""Launch helpers shared by every host path (attention, split-KV combine): the compiled kernel of a config on a
device, a launch by argument-record names on that device, and the device's SM count (cached).  Imports nothing of
the package but jit (lazily), so any host module can use it without an import cycle."""

from __future__ import annotations

import torch

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessor count, read once per device (a host property query, no sync)."""
    n = _SM_COUNT.get(device.index)
    if n is None:
        n = _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def compiled_kernel(cfg, device: torch.device):
    """Compiled kernel for ``cfg`` on ``device``'s target (plans are per device, so this runs once per plan)."""
    from .jit import get_kernel  # CuTe-DSL loads on the first launch, not at import

    with torch.cuda.device(device):
        return get_kernel(cfg)


def detached(t):
    """``t`` without autograd history (the kernels read the data only)."""
    return t.detach() if t.requires_grad else t


def launch(fn, record, device: torch.device, values: dict) -> None:
    args = record.pack(values)
    if device.index == torch._C._cuda_getDevice():  # torch.cuda.current_device() without its lazy-init check
        fn(*args)
    else:
        with torch.cuda.device(device):
            fn(*args)
