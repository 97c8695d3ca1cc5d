"""fp8_rows' device constants on the CPU (torch.cuda's stream and capture queries stubbed): the offsets, lengths and
unit descales an FP8 call used to rebuild with small torch kernels are kept per (device, stream, what, sizes), never
under CUDA-graph capture, at most _CONST_MAX of them, and never for a CPU device; their values are the ones the kernel
reads (tests/test_fp8_kvcache_gpu.py checks the launches and the capture on a GPU)."""

import types

import pytest
import torch

from flash_attn_4_sm120 import fp8_rows as R


@pytest.fixture
def cuda_stub(monkeypatch):
    """torch.cuda's current stream (settable) and capture state (settable), and an empty cache."""
    state = types.SimpleNamespace(stream=11, capturing=False, made=[])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        cuda_stream=state.stream))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(R, "_CONST", {})
    return state


def _make(state, value):
    def make(dev):
        state.made.append(dev)
        return torch.tensor([value])
    return make


def test_kept_per_stream_and_sizes(cuda_stub):
    dev = torch.device("cuda", 0)
    a = R._device_constant("cu", (4, 1), dev, _make(cuda_stub, 1))
    assert R._device_constant("cu", (4, 1), dev, _make(cuda_stub, 2)) is a  # a hit makes nothing
    assert len(cuda_stub.made) == 1
    assert R._device_constant("cu", (4, 2), dev, _make(cuda_stub, 3)) is not a  # other sizes
    assert R._device_constant("len", (4, 1), dev, _make(cuda_stub, 4)) is not a  # another constant
    cuda_stub.stream = 12
    other = R._device_constant("cu", (4, 1), dev, _make(cuda_stub, 5))
    assert other is not a and int(other) == 5  # another stream: its own tensor, made on that stream
    assert R._device_constant("cu", (4, 1), torch.device("cuda", 1), _make(cuda_stub, 6)) is not other


def test_not_kept_under_capture(cuda_stub):
    dev = torch.device("cuda", 0)
    cuda_stub.capturing = True
    first = R._device_constant("cu", (2, 8), dev, _make(cuda_stub, 1))
    second = R._device_constant("cu", (2, 8), dev, _make(cuda_stub, 2))
    assert first is not second and R._CONST == {}  # each call makes its own: graph-pool memory is never kept
    cuda_stub.capturing = False
    kept = R._device_constant("cu", (2, 8), dev, _make(cuda_stub, 3))
    assert len(R._CONST) == 1 and int(kept) == 3
    cuda_stub.capturing = True  # a tensor kept before the capture serves it (eager memory, never evicted)
    assert R._device_constant("cu", (2, 8), dev, _make(cuda_stub, 4)) is kept


def test_bounded(cuda_stub, monkeypatch):
    monkeypatch.setattr(R, "_CONST_MAX", 2)
    dev = torch.device("cuda", 0)
    for n in range(4):
        R._device_constant("cu", (n, 1), dev, _make(cuda_stub, n))
    assert len(R._CONST) == 2  # past the bound, made per call as before
    assert R._device_constant("cu", (3, 1), dev, _make(cuda_stub, 9)) is not R._device_constant(
        "cu", (3, 1), dev, _make(cuda_stub, 9))


def test_cpu_device_is_never_kept(cuda_stub):
    a = R.dense_cu(3, 5, "cpu")
    assert R.dense_cu(3, 5, "cpu") is not a and R._CONST == {}


def test_values():
    assert R.dense_cu(3, 5, "cpu").tolist() == [0, 5, 10, 15] and R.dense_cu(3, 5, "cpu").dtype == torch.int32
    assert R.uniform_lengths(3, 7, "cpu").tolist() == [7, 7, 7] and R.uniform_lengths(3, 7, "cpu").dtype == torch.int32
    one = R.unit_descale(2, 4, "cpu")
    assert one.shape == (2, 4) and one.dtype == torch.float32 and bool((one == 1).all())
