"""The on-disk compile cache heals itself (CPU: kernels compile for sm_120a on fake tensors, the .so loads through
tvm-ffi without a GPU).  A corrupt entry must never be loaded, and the next call must leave a good entry behind."""

import json
import shutil

import pytest

pytest.importorskip("cutlass")

from flash_attn_4_sm120 import compile_cache, config_bwd, jit  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_120a")
    monkeypatch.setenv("FA4_SM120_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FA4_SM120_DISK_CACHE", raising=False)
    monkeypatch.setattr(jit, "_MEMORY", {})
    compiles = []
    real = jit.compile_kernel
    monkeypatch.setattr(jit, "compile_kernel", lambda cfg, **kw: compiles.append(cfg) or real(cfg, **kw))
    return compiles


CFG = config_bwd.select_dq_config("bf16", 64, 64)
OTHER = config_bwd.select_dq_config("bf16", 64, 32)


def _paths(cfg):
    base = compile_cache.entry_path((jit.kernel_class(cfg).__name__, cfg, jit.target_arch()))
    return base.with_suffix(".so"), base, base.with_suffix(".json")


def _fresh_process():
    jit._MEMORY.clear()


def _entry_is_consistent(cfg):
    so, obj, manifest = _paths(cfg)
    m = json.loads(manifest.read_text())
    assert m["key"] == repr((jit.kernel_class(cfg).__name__, cfg, jit.target_arch()))
    for f in (so, obj):
        if f.exists():
            assert m["sha256"][f.name] == compile_cache.sha256_file(f)
    return m


def test_written_with_manifest_and_reloaded_without_compiling(cache):
    jit.get_kernel(CFG)
    assert len(cache) == 1
    m = _entry_is_consistent(CFG)
    assert _paths(CFG)[1].name in m["sha256"]
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 1  # loaded from disk


@pytest.mark.parametrize("damage", ["truncate_so", "zero_so", "zero_o", "no_manifest"])
def test_corrupt_entry_is_never_loaded_and_is_rewritten(cache, damage):
    jit.get_kernel(CFG)
    so, obj, manifest = _paths(CFG)
    if damage == "truncate_so":
        if not so.exists():
            pytest.skip("no C compiler: no .so to damage")
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])
        obj.write_bytes(obj.read_bytes()[:100])
    elif damage == "zero_so":
        if not so.exists():
            pytest.skip("no C compiler: no .so to damage")
        data = bytearray(so.read_bytes())
        data[len(data) // 2: len(data) // 2 + 1024] = bytes(1024)
        so.write_bytes(bytes(data))
        obj.write_bytes(b"")
    elif damage == "zero_o":
        so.unlink(missing_ok=True)
        data = bytearray(obj.read_bytes())
        data[len(data) // 2: len(data) // 2 + 1024] = bytes(1024)
        obj.write_bytes(bytes(data))
    else:
        manifest.unlink()
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 2, "the damaged entry must be recompiled, not loaded"
    _entry_is_consistent(CFG)
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 2, "after healing, later processes load from disk again"


def test_another_configurations_kernel_under_this_key_is_replaced(cache):
    jit.get_kernel(CFG)
    jit.get_kernel(OTHER)
    assert len(cache) == 2
    for src, dst in zip(_paths(OTHER), _paths(CFG)):
        if src.exists():
            shutil.copyfile(src, dst)
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 3 and cache[-1] == CFG
    _entry_is_consistent(CFG)


def test_empty_so_falls_back_to_the_object_and_is_relinked(cache):
    jit.get_kernel(CFG)
    so, obj, _ = _paths(CFG)
    if not so.exists():
        pytest.skip("no C compiler: no .so")
    so.write_bytes(b"")
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 1  # the verified .o loaded; nothing recompiled
    assert so.stat().st_size > 0, "the .so is linked again, so later processes do not pay for the .o path"
    _entry_is_consistent(CFG)


def test_entries_are_owner_only(cache):
    jit.get_kernel(CFG)
    so, obj, manifest = _paths(CFG)
    for f in (so, obj, manifest):
        if f.exists():
            assert f.stat().st_mode & 0o077 == 0, f"{f.name} is readable by others: {oct(f.stat().st_mode)}"
    assert obj.parent.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("which", ["root", "fingerprint"])
def test_cache_dir_writable_by_others_is_refused(cache, tmp_path, caplog, which):
    jit.get_kernel(CFG)  # a good entry exists
    compile_cache._REFUSED_DIRS.clear()
    so, obj, _ = _paths(CFG)
    target = tmp_path if which == "root" else obj.parent
    mode = target.stat().st_mode & 0o777
    target.chmod(0o777)
    try:
        _fresh_process()
        with caplog.at_level("WARNING", logger="flash_attn_4_sm120"):
            jit.get_kernel(CFG)
        assert len(cache) == 2, "a kernel from a directory others can write to must not be loaded"
        assert any("other users can write" in r.getMessage() and str(target) in r.getMessage()
                   for r in caplog.records), caplog.text
        _fresh_process()
        caplog.clear()
        with caplog.at_level("WARNING", logger="flash_attn_4_sm120"):
            jit.get_kernel(CFG)
        assert len(cache) == 3 and not caplog.records, "one warning per directory and process"
    finally:
        target.chmod(mode)
        compile_cache._REFUSED_DIRS.clear()
    _fresh_process()
    jit.get_kernel(CFG)
    assert len(cache) == 3, "a safe directory is used again"
