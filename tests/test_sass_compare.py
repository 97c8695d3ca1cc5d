"""scripts/sass_compare.py --rows (CPU, no compiling): two compile-gate runs compared configuration by
configuration by their ``sass_sha256``; the run record line is skipped, and rows of runs older than the field (or of
a configuration that failed to compile) count as unhashed, never as identical."""

import json
import sys
from pathlib import Path

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
