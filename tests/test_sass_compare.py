"""scripts/sass_compare.py --rows (CPU, no compiling): two compile-gate runs compared configuration by
configuration by their ``sass_sha256``; the run record line is skipped, and rows of runs older than the field (or of
a configuration that failed to compile) count as unhashed, never as identical."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import sass_compare  # noqa: E402


def _run(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": {"arch": "sm_120a"}}, *rows]))
    return path


def test_rows_are_sorted_by_what_their_digests_say(tmp_path, capsys):
    a = _run(tmp_path / "a.jsonl", [
        {"config": "same", "sass_sha256": "1" * 64}, {"config": "changed", "sass_sha256": "2" * 64},
        {"config": "old_row"}, {"config": "failed", "sass_sha256": None, "problems": ["compile failed"]},
        {"config": "gone", "sass_sha256": "3" * 64}])
    b = _run(tmp_path / "b.jsonl", [
        {"config": "same", "sass_sha256": "1" * 64}, {"config": "changed", "sass_sha256": "4" * 64},
        {"config": "old_row", "sass_sha256": "5" * 64}, {"config": "failed", "sass_sha256": "6" * 64},
        {"config": "new", "sass_sha256": "7" * 64}])
    got = sass_compare.compare_rows(sass_compare.read_rows(a), sass_compare.read_rows(b))
    assert got == {"identical": ["same"], "differing": ["changed"], "unhashed": ["failed", "old_row"],
                   "only_a": ["gone"], "only_b": ["new"]}
    assert sass_compare.main(["--rows", str(a), str(b)]) == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["identical"], summary["differing"], summary["unhashed"]) == (1, 1, 2)


def test_identical_runs_pass(tmp_path):
    rows = [{"config": f"c{i}", "sass_sha256": f"{i:064x}"} for i in range(3)]
    a, b = _run(tmp_path / "a.jsonl", rows), _run(tmp_path / "b.jsonl", rows[::-1])
    assert sass_compare.main(["--rows", str(a), str(b)]) == 0


def test_source_identity_ignores_docstrings_and_comments_only():
    """--source-identity: a docstring or comment change leaves the tree equal; a changed expression does not."""
    before = 'def f(x):\n    """doc"""\n    return x + 1  # one\n'
    assert sass_compare._top_level(before) == sass_compare._top_level(
        'def f(x):\n    """other words"""\n    # a comment\n    return x + 1\n')
    assert sass_compare._top_level(before) != sass_compare._top_level('def f(x):\n    return x + 2\n')


def test_source_identity_against_head_is_clean(capsys):
    """Every kernel module equals itself at HEAD (a fresh clone has the history CI fetches)."""
    import subprocess

    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "torch-ext/flash_attn_4_sm120/kernels"],
                      cwd=ROOT).returncode:
        pytest.skip("the working tree edits kernels/ (compared with HEAD they differ by design)")
    assert sass_compare.source_identity("HEAD") == 0
    out = capsys.readouterr().out
    assert "DIFFERS" not in out and "same tree    kernels/fwd_base.py" in out
