"""scripts/readme_sections.py on the CPU: a cell that failed its correctness check is reported and never ranked,
stale plots fail --check, and the files the 'how this bundle differs' rows cite exist."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import readme_sections as rs  # noqa: E402


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cell(d, causal, ours, fa2, fa4, **extra):
    return dict(shape=f"s{d}", hq=8, hkv=8, d=d, seqlen=1024, batch=16, causal=causal, extra=False, ours_tflops=ours,
                sdpa_flash_tflops=fa2, fa4_sm120_tflops=fa4, **extra)


def test_failed_check_is_reported_and_never_ranked(tmp_path, monkeypatch):
    bad = _cell(128, True, None, 300.0, 300.0, ours_error="check failed: dk: max error 1e-1 > bar 1e-3")
    del bad["ours_tflops"]
    rows = [_cell(128, False, 200.0, 100.0, 400.0), bad, _cell(256, False, 300.0, 300.0, 30.0),
            dict(kind="summary", device="dev")]
    monkeypatch.setattr(rs, "FWD_RESULTS", _write(tmp_path / "fwd.jsonl", rows))
    text = rs.bench_fwd_section()
    assert "1 cell(s) failed our correctness check" in text and "dk: max error" in text
    # the headline ranks the timed cells only: d <= 128 has one cell, 2.00x FA2 and 0.50x flash-attn-4
    line = next(x for x in text.splitlines() if x.startswith("| SDPA FLASH (FA2) |"))
    assert "d ≤ 128" not in line and line.split(" | ")[1].startswith("2.00×")
    line = next(x for x in text.splitlines() if x.startswith("| flash-attn-4 SM120 path |"))
    assert line.split(" | ")[1].startswith("0.50×") and line.split(" | ")[2].startswith("10.00×")


def test_decode_error_row_renders(tmp_path, monkeypatch):
    rows = [dict(case="d128", batch=1, kv_len=32768, q_len=1, hkv=8, d=128, copy_gbps=3000.0, device="dev",
                 ours_auto_error="check failed: out: max error 1 > bar 0.01")]
    monkeypatch.setattr(rs, "DECODE_RESULTS", _write(tmp_path / "decode.jsonl", rows))
    assert "error: check failed: out: max error 1" in rs.bench_decode_section()


def test_stale_plot_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(rs, "PLOTS_DIR", tmp_path)
    monkeypatch.setattr(rs, "PLOTS_INDEX", tmp_path / "plots.json")
    monkeypatch.setattr(rs, "ROOT", tmp_path.parent)
    with pytest.raises(SystemExit, match="not redrawn|drawn from older results"):
        rs.plots_section(check=True)
    index = {name: {"png": f"{name}.png", "data_sha256": rs._data_hash(fn())} for name, (fn, _, _) in rs.PLOTS.items()}
    (tmp_path / "plots.json").write_text(json.dumps(index))
    for name in rs.PLOTS:
        (tmp_path / f"{name}.png").write_bytes(b"png")
    assert "![" in rs.plots_section(check=True)  # hashes match: nothing to draw, no matplotlib needed
    index["fwd_tflops"]["data_sha256"] = "0" * 64
    (tmp_path / "plots.json").write_text(json.dumps(index))
    with pytest.raises(SystemExit, match="fwd_tflops"):
        rs.plots_section(check=True)


def test_differs_rows_cite_files_that_exist():
    text = rs.differs_section()
    cited = re.findall(r"`([\w./-]+\.(?:py|jsonl))`", text)
    assert cited
    for name in cited:
        hits = [p for p in (ROOT / name, ROOT / "benchmarks" / "results" / name, ROOT / "benchmarks" / name)
                if p.exists()]
        assert hits, f"the differs table cites {name}, which does not exist"
