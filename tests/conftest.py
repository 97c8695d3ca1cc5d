import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_tile_memo():
    """Tile choices and dispatch plans are memoised per tile-table version; tests that monkeypatch the tables get
    a fresh version before they run and after their patches are undone (this fixture tears down last)."""
    try:
        from flash_attn_4_sm120 import config
    except ImportError:  # the package is not importable in this environment
        yield
        return
    config.clear_caches()
    yield
    config.clear_caches()


@pytest.fixture
def wide_relay(monkeypatch):
    """The fused backward's relay form at every fused tile (d64, d96, d128), not only where deterministic=True takes
    it by default (config_bwd.RELAY_HEAD_DIMS): keeps the relay kernel tested where the pair serves those calls.
    (_fresh_tile_memo forgets the plans built under the wider table.)"""
    from flash_attn_4_sm120 import config_bwd

    monkeypatch.setattr(config_bwd, "RELAY_HEAD_DIMS", frozenset({64, 96, 128}))
