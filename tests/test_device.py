"""The device capability record (device.py) and the selection it drives, on the host: which devices are served,
the refusals (before any compile), the forced cp.async selection, and that no host module compares architecture
numbers.  No GPU needed: device properties are given, or ``device._query`` is replaced."""

import re
from pathlib import Path

import pytest
import torch

from flash_attn_4_sm120 import block_sparse as BS
from flash_attn_4_sm120 import config, device as DV, jit, plan as P

PKG = Path(DV.__file__).resolve().parent


def _caps(major, minor, smem=None, regs=None, name="test GPU"):
    return DV.caps_from_properties(name, major, minor, smem, regs, 80)


@pytest.fixture
def fake_device(monkeypatch):
    """device_caps(0) answers for a device of the given properties (and the record cache starts empty)."""
    monkeypatch.setattr(DV, "_CAPS", {})
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.delenv(DV.FORCE_CPASYNC_ENV, raising=False)

    def install(major, minor, smem=None, regs=None, name="test GPU"):
        monkeypatch.setattr(DV, "_query", lambda index: DV.caps_from_properties(name, major, minor, smem, regs, 80))
        monkeypatch.setattr(DV, "_CAPS", {})
    return install


@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9)])
def test_ampere_and_ada_have_no_tma_and_no_pdl(cap):
    c = _caps(*cap)
    assert (c.tma, c.pdl) == (False, False)
    assert c.arch == "sm_80"  # 8.6 and 8.9 load sm_80 cubins


@pytest.mark.parametrize("cap, arch", [((9, 0), "sm_90a"), ((12, 0), "sm_120a"), ((12, 1), "sm_121a")])
def test_hopper_and_blackwell_have_tma(cap, arch):
    c = _caps(*cap)
    assert (c.tma, c.pdl, c.arch) == (True, True, arch)


@pytest.mark.parametrize("cap", [(7, 5), (7, 0), (6, 1), (10, 0), (8, 7)])
def test_unknown_capability_is_refused_naming_device_capability_and_the_supported_ones(cap):
    with pytest.raises(DV.UnsupportedDeviceError) as e:
        _caps(*cap, name="Tesla T4")
    msg = str(e.value)
    assert f"Tesla T4 (compute capability {cap[0]}.{cap[1]})" in msg
    for (ma, mi), feat in DV.CAPABILITIES.items():
        assert f"{ma}.{mi} ({feat.arch}" in msg


def test_too_little_shared_memory_or_registers_is_refused_with_the_value_and_the_need():
    with pytest.raises(DV.UnsupportedDeviceError, match=rf"offers 65536 B of shared memory .* need "
                                                        rf"{config.SMEM_LIMIT_BYTES} B"):
        _caps(8, 6, smem=65536)
    with pytest.raises(DV.UnsupportedDeviceError, match=r"has 32768 registers per SM; the kernels need 65536"):
        _caps(12, 0, regs=32768)
    assert _caps(8, 6, smem=config.SMEM_LIMIT_BYTES).smem_per_block == config.SMEM_LIMIT_BYTES


def test_device_record_is_cached_per_device(fake_device, monkeypatch):
    calls = []
    monkeypatch.setattr(DV, "_query", lambda index: calls.append(index) or _caps(12, 0))
    DV.device_caps(0), DV.device_caps(0)
    assert calls == [0]


def test_unsupported_device_raises_through_device_caps(fake_device):
    fake_device(7, 5, name="Tesla T4")
    with pytest.raises(DV.UnsupportedDeviceError, match=r"Tesla T4 \(compute capability 7\.5\)"):
        DV.device_caps(0)


def test_forced_arch_that_does_not_match_the_device_is_refused(fake_device, monkeypatch):
    fake_device(8, 6, name="RTX 3090")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    with pytest.raises(DV.UnsupportedDeviceError,
                       match=r"CUTE_DSL_ARCH=sm_120a does not run on RTX 3090 \(compute capability 8\.6\).*sm_80"):
        DV.device_caps(0)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_86")  # an sm_86 cubin runs on an sm_86 device too
    assert DV.device_caps(0).arch == "sm_80"
    fake_device(12, 0)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with pytest.raises(DV.UnsupportedDeviceError, match="CUTE_DSL_ARCH=sm_90a"):
        DV.device_caps(0)


def test_target_arch_comes_from_the_table(fake_device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake_device(8, 9)
    assert jit.target_arch() == "sm_80"  # sm_80 cubins run on 8.6 / 8.9: the gate's sm_80 run covers them
    fake_device(9, 0)
    assert jit.target_arch() == "sm_90a"
    fake_device(7, 5)
    with pytest.raises(DV.UnsupportedDeviceError):
        jit.target_arch()


def test_force_cpasync_hook_is_read_per_call(fake_device, monkeypatch):
    fake_device(9, 0)
    assert DV.device_caps(0).tma
    monkeypatch.setenv(DV.FORCE_CPASYNC_ENV, "1")
    assert not DV.device_caps(0).tma and DV.device_caps(0).pdl  # TMA off, the rest of the device as it is
    monkeypatch.setenv(DV.FORCE_CPASYNC_ENV, "0")
    assert DV.device_caps(0).tma


def test_features_of_arch_for_the_gate():
    assert not DV.features_of_arch("sm_80").tma and not DV.features_of_arch("sm_80").pdl
    assert not DV.features_of_arch("sm_80").red_f32x2 and DV.features_of_arch("sm_120a").red_f32x2
    assert DV.features_of_arch("sm_120a").tma
    with pytest.raises(ValueError, match="sm_75"):
        DV.features_of_arch("sm_75")


# ---- selection without TMA ---------------------------------------------------------------------------------
def test_no_tma_selects_only_cpasync_tiles_for_every_pair():
    for d, dv in config.supported_head_dim_pairs():
        for windowed in (False, True):
            assert not config.select_fwd_tile(d, dv, windowed, tma=False).tma
            assert config.paged_tma_tile(d, dv, windowed, tma=False) is None
            for tile in config.sparse_tiles(d, dv, windowed, tma=False):
                assert not tile.tma
            assert not config.dropout_fwd_tile(d, dv, config.select_fwd_tile(d, dv, windowed, tma=False),
                                               tma=False).tma


def test_tma_devices_keep_the_tma_tiles():
    assert config.select_fwd_tile(128, 128, False).tma
    assert config.select_fwd_tile(128, 128, False, tma=True).tma
    assert config.paged_tma_tile(128, 128, False, 64) is not None


def test_no_tma_tile_is_the_cpasync_tile_of_the_same_row():
    assert config.select_fwd_tile(128, 128, False, tma=False) == config.FwdTile(128, 64, 8, 2, True)
    assert config.select_fwd_tile(64, 64, True, tma=False) == config.FwdTile(128, 128, 8, 2, True)
    assert config.select_fwd_tile(192, 192, False, tma=False) == config.FwdTile(128, 64, 8, 1, False)
    assert config.select_fwd_tile(256, 256, False, tma=False) == config.select_fwd_tile(256, 256, False)


def test_mods_with_dropout_without_tma():
    with pytest.raises(ValueError, match=r"head_dim=128, head_dim_v=128 runs only on a TMA tile.*no TMA"):
        config.mods_dropout_fwd_tile(128, 128, tma=False)
    assert not config.mods_dropout_fwd_tile(192, 192, tma=False).tma
    assert config.mods_dropout_fwd_tile(128, 128).tma


def test_block_ratios_follow_the_tile_the_device_runs():
    # d192: the TMA tile is 128x64, the cp.async tile of block-sparse calls 128x32
    assert BS.block_size_ratios((128, 64), 192, 192, False) == (1, 1)
    assert BS.block_size_ratios((128, 64), 192, 192, False, tma=False) == (1, 2)


def test_plan_without_tma_runs_cpasync_and_is_keyed_apart():
    args = ("bf16", 128, 128, False, False, False, False, False, False, False)
    with_tma = P.get_plan(P.PlanKey(*args, False, 0))
    without = P.get_plan(P.PlanKey(*args, False, 0, tma=False))
    assert with_tma.fwd_cfg.tile.tma and not without.fwd_cfg.tile.tma
    paged = P.get_plan(P.PlanKey(*args, False, 0, paged=True, paged_tma=True, tma=False))
    assert not paged.fwd_cfg.tile.tma
    split = P.get_plan(P.PlanKey(*args, False, 0, split=True, tma=False))
    assert split.fwd_cfg.split_kv and not split.fwd_cfg.tile.tma
    grad = P.get_plan(P.PlanKey(*args, True, 0, tma=False))
    assert grad.bwd_cfg is not None and not grad.fwd_cfg.tile.tma


# ---- no architecture-number comparisons outside the table ------------------------------------------------------
_ARCH_COMPARE = re.compile(r"(major|minor|arch|capability|\bcc)\w*\s*(>=|<=|>|<)\s*\d|"
                           r"get_device_capability\(|(?<!version_info)\.major\b")


def test_no_arch_number_comparisons_outside_device_py():
    offenders = []
    for src in sorted(PKG.rglob("*.py")):
        if src.name == "device.py":
            continue
        for n, line in enumerate(src.read_text().splitlines(), 1):
            if _ARCH_COMPARE.search(line.split("#")[0]):
                offenders.append(f"{src.relative_to(PKG)}:{n}: {line.strip()}")
    assert offenders == []


def test_the_arch_check_finds_a_comparison():
    assert _ARCH_COMPARE.search('return f"sm_{major}{minor}a" if major >= 9 else ""')
    assert _ARCH_COMPARE.search("major, minor = torch.cuda.get_device_capability()")
    assert _ARCH_COMPARE.search("if props.major == 8:")
    assert not _ARCH_COMPARE.search("sys.version_info.major")


def test_dropout_at_d192_without_tma_runs_the_32_key_tile():
    """The d192 row's cp.async tile spilled with dropout on sm_80 (benchmarks/results/gate_sm8x_probe.jsonl)."""
    row = config.select_fwd_tile(192, 192, False, tma=False)
    assert config.dropout_fwd_tile(192, 192, row, tma=False) == config.FwdTile(128, 32, 8, 2)
    assert config.dropout_fwd_tile(192, 128, row, tma=False) == config.FwdTile(128, 32, 8, 2)
    assert config.dropout_fwd_tile(192, 32, row, tma=False) == row  # 32 keys do not divide the dv=32 copy
    assert config.dropout_fwd_tile(192, 192, config.select_fwd_tile(192, 192, False), tma=True).tma
