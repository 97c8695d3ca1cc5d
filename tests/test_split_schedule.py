"""The split-KV schedule probe of test_split_schedule_gpu.py traced and compiled for sm_120a on the host (no GPU
needed): SplitBlockInfo's plan, split or not, windowed or not, compiles into a kernel."""

import os

import pytest

pytest.importorskip("cutlass.cute")

from test_split_schedule_gpu import _compile  # noqa: E402


def test_probe_compiles_for_sm120(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", os.environ.get("CUTE_DSL_ARCH", "sm_120a"))
    for windowed in (False, True):
        assert _compile(windowed) is not None and _compile(windowed, unsplit=True) is not None
