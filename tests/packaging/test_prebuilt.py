"""The prebuilt set (CPU): the committed set is what the sources select, the publish path builds a sample of it for
sm_120a, and the runtime loads only verified objects, falling back to the compiler for the rest.

The sample (one dQ-convert and one preprocess kernel, the cheapest kinds) is compiled for sm_120a through
``build_bundle.build(..., prebuilt=...)``, the function ``publish.py --prebuilt`` calls; its objects load through
tvm-ffi without a GPU (nothing is launched)."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("cutlass")

from hubtools import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
import build_bundle  # noqa: E402
import prebuilt_build  # noqa: E402
import prebuilt_set  # noqa: E402

from flash_attn_4_sm120 import compile_cache, jit, prebuilt  # noqa: E402

ARCH = "sm_120a"
SAMPLE = 2


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """build/torch-cuda with a sample of the sm_120a set, built by the publish path."""
    out = tmp_path_factory.mktemp("pb") / "build"
    meta = build_bundle.build(ROOT, out, prebuilt=dict(archs=[ARCH], sample_size=SAMPLE, jobs=1))
    return out / build_bundle.VARIANT, meta


@pytest.fixture
def runtime(bundle, tmp_path, monkeypatch):
    """This process as a fresh one on an sm_120a device, loading from the sample bundle, without a disk cache;
    returns the list of configurations compiled (the compiler is replaced by a counter)."""
    variant, _ = bundle
    monkeypatch.setenv("CUTE_DSL_ARCH", ARCH)
    monkeypatch.setenv("FA4_SM120_PREBUILT_DIR", str(variant / "prebuilt"))
    monkeypatch.setenv("FA4_SM120_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FA4_SM120_PREBUILT", raising=False)
    monkeypatch.setenv("FA4_SM120_DISK_CACHE", "0")  # the fake compiler's kernels cannot be exported
    monkeypatch.setattr(jit, "_MEMORY", {})
    compiled = []
    monkeypatch.setattr(jit, "compile_kernel", lambda cfg, **kw: compiled.append(cfg) or (lambda *a: None))
    prebuilt.reset()
    yield compiled
    prebuilt.reset()


def _entries(bundle):
    variant, _ = bundle
    manifest = json.loads((variant / "prebuilt" / ARCH / prebuilt.MANIFEST).read_text())
    cfgs = [prebuilt_build.key_from_text(e["key"])[1] for e in manifest["entries"].values()]
    return manifest, cfgs


def test_sample_manifest_records_versions_sources_and_sha256(bundle):
    variant, meta = bundle
    manifest, cfgs = _entries(bundle)
    assert manifest["arch"] == ARCH and manifest["format"] == prebuilt.FORMAT
    assert manifest["cutlass_dsl"] == compile_cache.dist_version("nvidia-cutlass-dsl") != "?"
    assert manifest["tvm_ffi"] == compile_cache.dist_version("apache-tvm-ffi") != "?"
    assert manifest["sources"] == compile_cache.source_digest(variant) == compile_cache.source_digest()
    assert len(manifest["entries"]) == SAMPLE
    assert sorted(e["kernel"] for e in manifest["entries"].values()) == ["FlashBwdDqConvert", "FlashBwdPreprocess"]
    for digest, e in manifest["entries"].items():
        f = variant / "prebuilt" / ARCH / e["file"]
        assert compile_cache.sha256_file(f) == e["sha256"] and f.stat().st_size == e["bytes"] > 10_000
        assert digest == prebuilt.key_digest(prebuilt_build.key_from_text(e["key"]))
        assert f"prebuilt/{ARCH}/{e['file']}" in meta["digest"]["files"]  # the bundle's digest covers it
    assert f"prebuilt/{ARCH}/{prebuilt.MANIFEST}" in meta["digest"]["files"]


def test_prebuilt_loads_without_compiling_and_writes_nothing(bundle, runtime, tmp_path, monkeypatch):
    variant, _ = bundle
    monkeypatch.delenv("FA4_SM120_DISK_CACHE")
    before = {p: p.stat().st_mtime_ns for p in (variant / "prebuilt").rglob("*")}
    _, cfgs = _entries(bundle)
    for cfg in cfgs:
        assert callable(jit.get_kernel(cfg))
    assert runtime == [], "a configuration of the set must load, not compile"
    assert not (tmp_path / "cache").exists(), "a prebuilt kernel is not copied into the disk cache"
    assert {p: p.stat().st_mtime_ns for p in (variant / "prebuilt").rglob("*")} == before


def test_outside_the_set_compiles_as_before(runtime):
    from flash_attn_4_sm120 import config_bwd

    cfg = config_bwd.select_dq_config("bf16", 64, 32)
    jit.get_kernel(cfg)
    assert runtime == [cfg]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "missing"])
def test_damaged_object_falls_back_for_that_configuration_only(bundle, runtime, tmp_path, caplog, damage):
    variant, _ = bundle
    manifest, cfgs = _entries(bundle)
    copy = tmp_path / "prebuilt"
    import shutil

    shutil.copytree(variant / "prebuilt", copy)
    os.environ["FA4_SM120_PREBUILT_DIR"] = str(copy)  # restored by monkeypatch's setenv teardown
    bad_cfg = cfgs[0]
    bad = copy / ARCH / manifest["entries"][prebuilt.key_digest(jit.kernel_key(bad_cfg))]["file"]
    if damage == "corrupt":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
    elif damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:1000])
    else:
        bad.unlink()
    with caplog.at_level("WARNING", logger="flash_attn_4_sm120"):
        for cfg in cfgs:
            jit.get_kernel(cfg)
    assert runtime == [bad_cfg], "only the damaged configuration compiles"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings


@pytest.mark.parametrize("field", ["cutlass_dsl", "tvm_ffi", "sources"])
def test_version_or_source_mismatch_ignores_the_set_with_one_line(bundle, runtime, monkeypatch, caplog, field):
    _, cfgs = _entries(bundle)
    if field == "sources":
        monkeypatch.setattr(prebuilt, "source_digest", lambda: "0" * 64)
    else:
        real = prebuilt.runtime_versions()
        monkeypatch.setattr(prebuilt, "runtime_versions", lambda: {**real, field: "9.9.9"})
    with caplog.at_level("INFO", logger="flash_attn_4_sm120"):
        for cfg in cfgs:
            jit.get_kernel(cfg)
    assert runtime == cfgs, "a set built for other versions is never loaded"
    lines = [r.getMessage() for r in caplog.records if "prebuilt" in r.getMessage()]
    assert len(lines) == 1 and field in lines[0], lines


def test_arch_not_in_the_set_compiles_with_one_line(bundle, runtime, monkeypatch, caplog):
    _, cfgs = _entries(bundle)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with caplog.at_level("INFO", logger="flash_attn_4_sm120"):
        for cfg in cfgs:
            jit.get_kernel(cfg)
    assert runtime == cfgs
    lines = [r.getMessage() for r in caplog.records if "prebuilt" in r.getMessage()]
    assert len(lines) == 1 and "sm_90a" in lines[0] and ARCH in lines[0], lines


def test_prebuilt_dir_writable_by_others_is_not_trusted(bundle, runtime, tmp_path, caplog):
    variant, _ = bundle
    import shutil

    copy = tmp_path / "prebuilt"
    shutil.copytree(variant / "prebuilt", copy)
    (copy / ARCH).chmod(0o777)
    os.environ["FA4_SM120_PREBUILT_DIR"] = str(copy)
    _, cfgs = _entries(bundle)
    with caplog.at_level("WARNING", logger="flash_attn_4_sm120"):
        for cfg in cfgs:
            jit.get_kernel(cfg)
    assert runtime == cfgs
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "other users can write" in lines[0] and str(copy / ARCH) in lines[0], lines


def test_prebuilt_switch_off(bundle, runtime, monkeypatch):
    _, cfgs = _entries(bundle)
    monkeypatch.setenv("FA4_SM120_PREBUILT", "0")
    jit.get_kernel(cfgs[0])
    assert runtime == [cfgs[0]]


def test_sample_is_one_of_each_cheap_kind():
    entries = prebuilt_set.committed()["sets"][ARCH]
    picked = prebuilt_build.sample(entries, 4)
    assert [e["kernel"] for e in picked] == list(prebuilt_build.KIND_ORDER[:4])
    assert picked == prebuilt_build.sample(entries, 4)


def test_readme_calls_are_the_readme_examples():
    readme = (ROOT / "README.md").read_text()
    for call in prebuilt_set.README_CALLS:
        assert call["text"] in readme, f"README no longer shows {call['text']!r}: update prebuilt_set.README_CALLS"


def test_committed_set_matches_the_sources():
    """The set the committed prebuilt_set.json declares is what the scenarios, README and benchmarks select
    today (recomputed: transformers runs the scenarios' small models on the CPU)."""
    pytest.importorskip("transformers")
    committed = prebuilt_set.committed()
    fresh = json.loads(prebuilt_set.set_json(prebuilt_set.derive()))
    assert fresh == committed, "stale: run python scripts/prebuilt_set.py and commit it"
    for arch in committed["publish_archs"]:
        kinds = {e["kernel"] for e in committed["sets"][arch]}
        # bf16 and fp16, forward and backward, paged and split decode, combine, preprocess, dQ convert
        assert {"FlashFwdTma", "FlashFwdCpAsync", "FlashFwdDecode", "FlashCombine", "FlashBwdPreprocess",
                "FlashBwdDqConvert", "FlashBwdDq"} <= kinds, kinds
        names = [e["name"] for e in committed["sets"][arch]]
        for needle in ("_paged", "_split", "fwd_fp16", "fwd_bf16"):
            assert any(needle in n for n in names), needle


def test_publish_uploads_the_build_with_a_prebuilt_sample(tmp_path):
    """publish.py --prebuilt (a one-kernel sample) uploads the variant with its objects and manifest, in its digest,
    and ``--report`` appends the set's size row."""
    from hub_server import LocalHub
    from hubtools import git, isolated_env, make_project, script

    project = make_project(tmp_path / "proj")
    assert script("build_bundle.py", "--root", str(project)).returncode == 0
    git(project, "add", "build")
    git(project, "commit", "-q", "-m", "build")
    repo = "kernels-test/flash-attn-4-sm120"
    with LocalHub(tmp_path / "hub", write_token="hf_local_test_token") as hub:
        env = isolated_env(tmp_path, HF_TOKEN="hf_local_test_token")
        proc = script("publish.py", "--root", str(project), "--repo-id", repo, "--endpoint", hub.endpoint,
                      "--prebuilt", "--arch", ARCH, "--sample", "1", "--jobs", "1",
                      "--report", str(tmp_path / "size.jsonl"), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        files = hub.store.files(repo, hub.store.branches(repo)["v1"])
    base = f"build/torch-cuda/prebuilt/{ARCH}/"
    manifest = json.loads(files[base + prebuilt.MANIFEST].read_text())
    (digest, entry), = manifest["entries"].items()
    assert entry["kernel"] == prebuilt_build.KIND_ORDER[0]
    assert compile_cache.sha256_file(files[base + entry["file"]]) == entry["sha256"]
    meta = json.loads(files["build/torch-cuda/metadata.json"].read_text())
    assert f"prebuilt/{ARCH}/{entry['file']}" in meta["digest"]["files"]
    assert not (project / "build" / "torch-cuda" / "prebuilt").exists(), "the committed build never gets objects"
    (row,) = [json.loads(line) for line in (tmp_path / "size.jsonl").read_text().splitlines()]
    assert row["kind"] == "prebuilt_size" and row["arch"] == ARCH and row["sample"] == 1
    assert row["configurations"] == 1 and row["bytes"] == entry["bytes"] and row["jobs"] == 1
