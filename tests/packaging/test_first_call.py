"""The first-call benchmark and the prebuilt set's size report on the CPU: bench_jit's row summary, the size row
the publish path appends (``--report``), and the README sections rendered from both results files
(scripts/readme_prebuilt.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from hubtools import ROOT

sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "benchmarks")]
import bench_jit  # noqa: E402
import prebuilt_build  # noqa: E402
import readme_prebuilt as rp  # noqa: E402


def _run(seconds, load=0.05, compile_s=0.0, **extra):
    return dict(seconds=seconds, second_s=0.001, import_s=1.0, torch_autograd_first_s=None, load_s=load,
                runtime_s=0.03, compile_s=compile_s, compiles=0, prebuilt_loaded=1, disk_loaded=0,
                cutlass_imported=False, **extra)


def test_summary_is_the_median_run_with_its_breakdown():
    runs = [_run(0.30, load=0.2), _run(0.10, load=0.05), _run(0.20, load=0.08)]
    row = bench_jit.summarize("prebuilt", "fwd", runs)
    assert row["seconds"] == 0.2 and row["load_s"] == 0.08, row  # the median run, not a mix of runs
    assert row["all_s"] == [0.3, 0.1, 0.2] and row["runs"] == 3
    assert abs(row["rest_s"] - 0.12) < 1e-9
    even = bench_jit.summarize("prebuilt", "fwd", [_run(0.4), _run(0.2)])
    assert even["seconds"] == 0.2  # the lower middle of an even count: a run that happened


def test_sdpa_rows_have_no_breakdown():
    row = bench_jit.summarize("sdpa", "fwd", [dict(seconds=0.05, second_s=0.001, import_s=1.0,
                                                    torch_autograd_first_s=None)])
    assert "rest_s" not in row and row["seconds"] == 0.05


def test_bench_jit_refuses_both_prebuilt_options():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_jit.py"), "--prebuilt-dir", "a",
                           "--build-prebuilt", "b"], capture_output=True, text=True)
    assert proc.returncode == 2 and "not both" in proc.stderr


def _manifest(sizes):
    entries = {f"d{i}": {"kernel": kind, "bytes": n, "file": f"d{i}.so"} for i, (kind, n) in enumerate(sizes)}
    return {"arch": "sm_120a", "cutlass_dsl": "4.8.1", "tvm_ffi": "0.1.15.post2", "sources": "ab" * 32,
            "entries": entries}


def test_size_row_totals_and_kinds():
    m = _manifest([("FlashFwdTma", 150_000), ("FlashFwdTma", 130_000), ("FlashCombine", 50_000)])
    row = prebuilt_build.size_row(m, sample_size=None, jobs=60, seconds=91.26)
    assert row["configurations"] == 3 and row["bytes"] == 330_000 and row["mb"] == 0.33
    assert row["largest_kb"] == 150.0 and row["build_s"] == 91.3 and row["sample"] is None
    assert row["by_kernel"] == {"FlashCombine": {"objects": 1, "mb": 0.05}, "FlashFwdTma": {"objects": 2, "mb": 0.28}}
    assert row["sources"] == "ab" * 8 and row["arch"] == "sm_120a"
    assert row["libs"] in ("cu12", "cu13", "cu12+cu13", "?"), row["libs"]


def test_report_needs_prebuilt():
    for script in ("build_bundle.py", "publish.py"):
        args = ["--report", "x.jsonl"] + (["--repo-id", "a/b"] if script == "publish.py" else [])
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True,
                              text=True, cwd=ROOT / "scripts")
        assert proc.returncode == 2 and "--report needs --prebuilt" in proc.stderr, (script, proc.stderr)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_size_section_shows_the_newest_full_build_per_arch(tmp_path, monkeypatch):
    m = _manifest([("FlashFwdTma", 150_000)])
    old = prebuilt_build.size_row(m, sample_size=None, jobs=8, seconds=10)
    new = {**old, "mb": 41.5, "configurations": 140, "build_s": 95.0, "jobs": 60, "cpus": 64}
    sample = prebuilt_build.size_row(m, sample_size=1, jobs=2, seconds=5)
    monkeypatch.setattr(rp, "SIZE_RESULTS", _write(tmp_path / "size.jsonl", [old, new, sample]))
    text = rp.size_section()
    table = [ln for ln in text.splitlines() if ln.startswith("| sm_120a")]
    assert table == [f"| sm_120a | 140 | 41.5 MB | 150 KB | no | 95 s (60 workers, 64 CPUs) | 4.8.1 ({new['libs']} "
                     "libs) |"], text
    assert "Newest sample build: 1 configurations" in text
    monkeypatch.setattr(rp, "SIZE_RESULTS", _write(tmp_path / "only-sample.jsonl", [sample]))
    text = rp.size_section()
    assert "No full build" in text and "| sm_120a" not in text


def _first_call_run(prebuilt_s):
    rows = [bench_jit.summarize(src, call, [_run(s, compile_s=c)])
            for src, c, s in (("cold_jit", 6.5, 7.0), ("warm_disk", 0.0, 0.15), ("prebuilt", 0.0, prebuilt_s))
            for call in ("fwd", "fwd_bwd")]
    rows.append(bench_jit.summarize("sdpa", "fwd", [dict(seconds=0.04, second_s=0.001, import_s=1.0,
                                                          torch_autograd_first_s=None)]))
    return dict(kind="first_call", device="NVIDIA H100", torch="2.11", shape=bench_jit.SHAPE_TEXT,
                prebuilt_set=dict(arch="sm_90a", configurations=132, mb=10.4, build_s=80.0), rows=rows)


def test_first_call_section_renders_the_last_run_and_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr(rp, "FIRST_CALL_RESULTS", _write(tmp_path / "fc.jsonl", [_first_call_run(0.5),
                                                                                  _first_call_run(0.12)]))
    text = rp.first_call_section()
    assert "| prebuilt set | 120 ms | 120 ms | 0 / 0 | loading 50 ms (of which tvm-ffi's import and the runtime " \
           "library 30 ms), launch and GPU 70 ms |" in text, text
    assert "compiling 6.50 s" in text  # the cold row
    assert "| cold JIT (compile) | 7.00 s |" in text and "| torch SDPA (floor) | 40 ms | — | — | — |" in text
    assert "0.3 s: 120 ms, met" in text and "132 objects, 10.4 MB" in text
    monkeypatch.setattr(rp, "FIRST_CALL_RESULTS", _write(tmp_path / "fc2.jsonl", [_first_call_run(0.5)]))
    assert "0.3 s: 500 ms, not met" in rp.first_call_section()
    monkeypatch.setattr(rp, "FIRST_CALL_RESULTS", tmp_path / "missing.jsonl")
    assert "No GPU run" in rp.first_call_section()


def test_sources_and_versions_are_read_once_per_process(monkeypatch):
    """A first call that misses the prebuilt set checks its manifest (sources digest, versions) and then names the
    disk cache entry (fingerprint: the same digest and versions): the package's sources are walked once."""
    from pathlib import Path

    from flash_attn_4_sm120 import compile_cache, prebuilt

    monkeypatch.setattr(compile_cache, "_SOURCE_DIGEST", None)
    monkeypatch.setattr(compile_cache, "_FINGERPRINT", None)
    monkeypatch.setattr(compile_cache, "_VERSIONS", {})
    walks, lookups = [], []
    real_rglob = Path.rglob
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: walks.append(self) or real_rglob(self, pattern))
    import importlib.metadata as md

    real_version = md.version
    monkeypatch.setattr(md, "version", lambda name: lookups.append(name) or real_version(name))
    digest, versions = prebuilt.source_digest(), prebuilt.runtime_versions()
    fp = compile_cache.fingerprint()
    assert len(walks) == 1 and sorted(lookups) == ["apache-tvm-ffi", "nvidia-cutlass-dsl"], (walks, lookups)
    assert versions == {"cutlass_dsl": compile_cache.dist_version("nvidia-cutlass-dsl"),
                        "tvm_ffi": compile_cache.dist_version("apache-tvm-ffi")} and len(lookups) == 2
    pkg = Path(compile_cache.__file__).absolute().parent
    assert compile_cache.source_digest(pkg) == digest and len(walks) == 2  # a named directory is always hashed
    monkeypatch.setattr(compile_cache, "_FINGERPRINT", None)
    monkeypatch.setattr(compile_cache, "_SOURCE_DIGEST", "0" * 64)
    assert compile_cache.fingerprint() != fp, "the sources digest is part of the disk cache's fingerprint"


def test_build_set_builds_the_device_arch_through_the_publish_path(tmp_path, monkeypatch):
    """bench_jit --build-prebuilt DIR: build_bundle.build (what publish.py --prebuilt calls) for the device's arch,
    once; a DIR that already holds that arch's set is reused."""
    from types import SimpleNamespace

    import build_bundle

    from flash_attn_4_sm120 import device

    monkeypatch.setattr(device, "device_caps", lambda dev: SimpleNamespace(arch="sm_90a"))
    calls = []

    def fake_build(root, out, prebuilt):
        calls.append((root, out, prebuilt))
        d = out / build_bundle.VARIANT / "prebuilt" / "sm_90a"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps(_manifest([("FlashFwdTma", 2_000_000)])))

    monkeypatch.setattr(build_bundle, "build", fake_build)
    out = tmp_path / "b"
    prebuilt_dir, info = bench_jit.build_set(out, 7)
    assert calls == [(ROOT, out, {"archs": ["sm_90a"], "jobs": 7})]
    assert prebuilt_dir == out / "torch-cuda" / "prebuilt"
    assert info["arch"] == "sm_90a" and info["configurations"] == 1 and info["mb"] == 2.0
    bench_jit.build_set(out, 7)
    assert len(calls) == 1, "a directory holding the set is reused"


def test_the_bench_cell_is_in_the_declared_set_of_every_arch():
    """bench_jit's prebuilt rows must load, never compile: its forward and its forward + backward select only
    configurations of the committed set, on each arch's first listed device (the dispatcher replayed on the CPU)."""
    import pytest

    pytest.importorskip("cutlass")
    import torch

    import flash_attn_4_sm120 as fa
    import prebuilt_set

    b, s, h, hkv, d = (bench_jit.SHAPE[k] for k in ("batch", "seqlen", "heads", "kv_heads", "head_dim"))
    committed = prebuilt_set.committed()["sets"]
    for arch, devices in prebuilt_set.DEVICES.items():
        keys = {e["key"] for e in committed[arch]}
        name, capability, sms = devices[0]
        for grad in (False, True):
            record = []
            with prebuilt_set.stubbed_device(arch, name, capability, sms, record):
                q = torch.empty(b, s, h, d, dtype=torch.bfloat16).requires_grad_(grad)
                k, v = (torch.empty(b, s, hkv, d, dtype=torch.bfloat16).requires_grad_(grad) for _ in range(2))
                out, _ = fa.flash_attn_func(q, k, v, causal=True)
                if grad:
                    out.backward(torch.ones_like(out))
            assert record and all(repr(key) in keys for key in record), (arch, grad, record)
            assert any(key[0].startswith("FlashBwd") for key in record) == grad, record
