"""scripts/gate_merge.py: shard files of one full gate run join into the file CI reads, and files that are not
shards of one run are refused."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import gate_merge  # noqa: E402

META = {"arch": "sm_120a", "cutlass_dsl": "4.8.1", "libs": "cu13", "commit": "abc", "sources": {"k.py": "1"},
        "jobs": 12, "configs": 2}


def _shard(path: Path, names, **meta):
    rows = [{"meta": {**META, **meta}}] + [{"config": n, "problems": [], "regs": 1} for n in names]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_shards_join_sorted_with_the_total(tmp_path):
    a = _shard(tmp_path / "a.jsonl", ["fwd_b", "fwd_a"])
    b = _shard(tmp_path / "b.jsonl", ["bwd_c"], jobs=8)
    out = tmp_path / "full.jsonl"
    assert gate_merge.main([str(a), str(b), "--shards", "2", "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["meta"]["configs"] == 3 and lines[0]["meta"]["shards"] == 2
    assert lines[0]["meta"]["sources"] == META["sources"]
    assert [r["config"] for r in lines[1:]] == ["bwd_c", "fwd_a", "fwd_b"]


@pytest.mark.parametrize("bad", [{"sources": {"k.py": "2"}}, {"commit": "def"}, {"libs": "cu12"}, {"arch": "sm_80"}])
def test_shards_of_different_runs_are_refused(tmp_path, bad):
    a = _shard(tmp_path / "a.jsonl", ["x"])
    b = _shard(tmp_path / "b.jsonl", ["y"], **bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        gate_merge.merge([a, b], 2)


def test_a_name_twice_or_a_missing_shard_is_refused(tmp_path):
    a = _shard(tmp_path / "a.jsonl", ["x"])
    b = _shard(tmp_path / "b.jsonl", ["x"])
    with pytest.raises(ValueError, match="in both"):
        gate_merge.merge([a, b], 2)
    with pytest.raises(ValueError, match="every shard"):
        gate_merge.merge([a], 2)
    assert gate_merge.main([str(a), "--shards", "2", "--out", str(tmp_path / "o.jsonl")]) == 2
