"""The compile gate builds every configuration class the dispatcher can select (CPU, no compile).

A class is (kernel, tile, dtype, head_dim, head_dim_v, mode) (scripts/gate_classes.py).  This test walks the
dispatcher's plans itself, more widely than the gate's own walk (every decode row count, a grid of block sizes and
page sizes, every flag subset with and without grad), and fails when a class it reaches is not in the gate's
worklist for the target (sm_120a with TMA, sm_80 without).  Then the sharding CI uses, and the freshness check of
the committed full runs, on a throw-away git repository.
"""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import compile_gate as G  # noqa: E402
from scripts import gate_ci as GC  # noqa: E402
from scripts import gate_classes as C  # noqa: E402

G._package()
from flash_attn_4_sm120 import block_sparse as BS, config, config_bwd, config_decode, plan as P  # noqa: E402

TARGETS = {"sm_120a": (True, True, True), "sm_80": (False, False, False)}  # (tma, pdl, red_f32x2)


def _walk(tma: bool, pdl: bool, red: bool) -> set:
    """Classes reached through plan.get_plan: forward modes over window on/off (the plan key's other flags do not
    pick forward tiles: checked for the plain mode below), the backward over every flag subset, and the fused
    backward dispatch_bwd runs in place of the kernel pair (config_bwd.fused_for) where the target has vector
    reductions."""
    seen = set()

    def add(plan):
        fused = config_bwd.fused_for(plan.bwd_cfg) if red and plan.bwd_cfg is not None else None
        for cfg in (plan.fwd_cfg, plan.bwd_cfg, plan.dq_cfg, fused and fused[0]):
            if cfg is not None and C.class_key(cfg) is not None:
                seen.add(C.class_key(cfg))

    for dtype in config.DTYPES:
        for d, dv in config.supported_head_dim_pairs():
            for w in (False, True):
                base = (dtype, d, dv, w, False, False, False, False, False, False)
                fwd = [dict()]
                fwd += [dict(paged=True, paged_tma=config.paged_tma_tile(d, dv, w, ps, tma=tma) is not None)
                        for ps in (1, 16, 64, 128, 256)]
                if pdl:
                    fwd += [dict(split=True), dict(split=True, paged=True)]
                for rows in range(1, config_decode.DECODE_MAX_ROWS + 1):
                    tile = config_decode.decode_tile(d, dv, rows)
                    if tile is not None:
                        fwd += [dict(decode=tile.tile_m, paged=p, split=s) for p in (False, True)
                                for s in ((False, True) if pdl else (False,))]
                for qb, kb in itertools.product((64, 128, 256, 384), (16, 32, 64, 96, 128, 192, 256)):
                    try:
                        ratios = BS.block_size_ratios((qb, kb), d, dv, w, tma)
                    except ValueError:
                        continue
                    fwd.append(dict(sparse=(*ratios, qb, kb)))
                fwd += [dict(dropout=True, dropout_packed=p, dropout_high_p=h) for p in (False, True)
                        for h in (False, True)]
                for kw in fwd:
                    try:
                        add(P.get_plan(P.PlanKey(*base, False, 0, tma=tma, **kw)))
                    except ValueError:
                        pass
            for flags in itertools.product((False, True), repeat=7):
                for kw in (dict(), dict(dropout=True), dict(sparse=(1, 1, 128, 128), sparse_bwd=(1, 1, 1, 1)),
                           dict(sparse=(2, 2, 256, 256), sparse_bwd=(2, 2, 2, 2))):
                    try:
                        add(P.get_plan(P.PlanKey(dtype, d, dv, *flags, True, 0, tma=tma, **kw)))
                    except ValueError:
                        pass
    return seen


def _missing(arch: str, worklist) -> list:
    gate = {C.class_key(c) for c in worklist}
    return sorted(_walk(*TARGETS[arch]) - gate, key=repr)


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_every_selectable_class_is_in_the_gate_worklist(arch):
    missing = _missing(arch, G._worklist(None, arch))
    assert missing == [], f"{len(missing)} classes the dispatcher selects are not built by the gate, e.g. {missing[:5]}"


def test_the_check_finds_a_missing_class():
    """Without the class sweep the gate's hand-made worklists miss classes (the reason the sweep exists)."""
    assert _missing("sm_120a", G._worklist(None, "sm_120a", classes=False))


def test_forward_tiles_do_not_depend_on_the_other_plan_flags():
    """The walk above varies only the window for the forward; the plan's forward tile must not change with the
    other flags of its key."""
    for d, dv in config.supported_head_dim_pairs():
        for w in (False, True):
            tiles = {P.get_plan(P.PlanKey("bf16", d, dv, w, *flags, False, 0)).fwd_cfg.tile
                     for flags in itertools.product((False, True), repeat=6)}
            assert len(tiles) == 1, (d, dv, w, tiles)


def test_no_tma_targets_build_no_tma_tile_and_no_split():
    for cfg in G._worklist(None, "sm_80"):
        assert not getattr(getattr(cfg, "tile", None), "tma", False), cfg.name()
        assert not getattr(cfg, "split_kv", False), cfg.name()
        assert not getattr(cfg, "fused_dq", False), cfg.name()  # red.global.add.v2.f32 is sm_90+


# ---- sharding --------------------------------------------------------------------------------------------------
def test_shards_partition_the_worklist_deterministically():
    names = [c.name() for c in G._worklist(None, "sm_120a")]
    count = GC.CI_SHARDS["sm_120a"]
    shards = [[n for n in names if GC.in_shard(n, i, count)] for i in range(count)]
    assert sorted(sum(shards, [])) == sorted(names)
    assert all(len(s) < len(names) / 2 for s in shards)  # no shard is most of the work
    assert GC.in_shard("fwd_bf16_d128v128_128x64w8s2qt", 0, 4) == GC.in_shard("fwd_bf16_d128v128_128x64w8s2qt", 0, 4)
    assert 0 <= GC.ci_shard_index(count) < count


def test_changed_kernel_files_pick_their_kinds():
    assert GC.kinds_to_rebuild(["fwd_tma.py"]) == {"fwd_tma"}
    assert GC.kinds_to_rebuild(["fwd_cpasync.py"]) == {"fwd_cpasync", "fwd_decode"}
    assert GC.kinds_to_rebuild(["softmax.py"]) == set(C.KERNEL_FILES)  # shared: everything
    assert GC.kinds_to_rebuild([]) == set()


# ---- freshness of the committed full runs ------------------------------------------------------------------
def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", *args], check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    (tmp_path / GC.PKG / "kernels").mkdir(parents=True)
    (tmp_path / GC.PKG / "kernels" / "fwd_tma.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "kernels")
    monkeypatch.setattr(GC, "ROOT", tmp_path)
    return tmp_path


def _write_full(repo, rows, commit=True):
    path = repo / "benchmarks" / "results" / "gate_full_sm_120a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if commit:
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "full gate")


def test_full_run_missing_uncommitted_fresh_and_stale(repo):
    names = ["a", "b"]
    assert "is missing" in GC.full_run_problems("sm_120a", names)[0]
    _write_full(repo, [{"config": "a", "problems": []}, {"config": "b", "problems": []}], commit=False)
    assert "not committed" in GC.full_run_problems("sm_120a", names)[0]
    _write_full(repo, [{"config": "a", "problems": []}, {"config": "b", "problems": []}])
    assert GC.full_run_problems("sm_120a", names) == []
    (repo / GC.PKG / "kernels" / "fwd_tma.py").write_text("x = 2\n")
    assert GC.changed_kernel_files(GC.last_commit("benchmarks/results/gate_full_sm_120a.jsonl")) == ["fwd_tma.py"]
    _git(repo, "commit", "-qam", "kernel edit")
    problems = GC.full_run_problems("sm_120a", names)
    assert len(problems) == 1 and "is older than" in problems[0] and "last commit touching" in problems[0]


def test_full_run_with_a_failure_or_a_missing_configuration(repo):
    _write_full(repo, [{"config": "a", "problems": ["spills (2 STL/LDL, frame 8 B)"]}])
    problems = GC.full_run_problems("sm_120a", ["a", "b"])
    assert any("1 failing configurations, e.g. a" in p for p in problems)
    assert any("lacks 1 of today's 2 configurations (e.g. b)" in p for p in problems)


def test_ci_builds_the_shard_and_fails_without_a_full_run(monkeypatch):
    """--ci with no committed full run: it fails (naming the file to commit), and builds the shard only (not
    "everything changed since a run that does not exist")."""
    import argparse

    built = []
    monkeypatch.setattr(GC, "FULL_ARCHS", ("sm_80",))
    monkeypatch.setattr(GC, "CI_SHARDS", {"sm_80": 8})
    monkeypatch.setattr(GC, "full_run_path", lambda arch: ROOT / "benchmarks" / "results" / "gate_full_none.jsonl")
    monkeypatch.setattr(G, "_gate", lambda work, args: built.append((args.arch, [c.name() for c in work])) or 0)
    assert G._ci(argparse.Namespace(ci=True, jobs=1, json=None)) == 1
    (arch, names), = built
    index = GC.ci_shard_index(8)
    assert arch == "sm_80" and names and all(GC.in_shard(n, index, 8) for n in names)
