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
from flash_attn_4_sm120 import block_sparse as BS, compat, config, config_bwd, config_decode, plan as P  # noqa: E402

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
                    key = P.PlanKey(dtype, d, dv, *flags, True, 0, tma=tma, **kw)
                    if compat.plan_key_conflicts(key):  # the call refuses it before planning
                        continue
                    try:
                        add(P.get_plan(key))
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


# ---- the walk meets only what a call can run ------------------------------------------------------------------
def test_the_walk_builds_no_paged_call_with_cu_seqlens_k():
    """A call refuses page_table with cu_seqlens_k (compat.check_call), and so does the plan: the class walk,
    which enumerates every flag subset with every mode, keeps no paged configuration with varlen k (they were 149
    "unreachable" classes that failed to compile, benchmarks/results/gate_classes_sm120a_shard0_s30.jsonl)."""
    for arch in TARGETS:
        work = G._worklist(None, arch)
        paged = [c for c in work if getattr(c, "paged", False)]
        assert paged and not [c.name() for c in paged if c.varlen_k]
        # the heaviest paged set is still built: every other flag on
        assert any(c.windowed and c.has_softcap and c.has_sink and c.varlen_q and c.seqused_k for c in paged)


@pytest.mark.parametrize("kw,name", [(dict(vk=True), "paged_cu_seqlens_k"), (dict(needs_grad=True), "paged_grad"),
                                     (dict(dropout=True), "dropout_paged"),
                                     (dict(sparse=(1, 1, 128, 128)), "sparse_paged")])
def test_the_class_sweep_skips_what_paged_calls_cannot_run(kw, name):
    """The sweep skips plan keys that carry a pair the call refuses (compat.plan_key_conflicts, the table's own
    names); the planner itself raises no refusal (one raise site per refusal: compat.check_call)."""
    from flash_attn_4_sm120 import compat

    flags = dict(windowed=False, softcap=False, sink=False, vq=False, vk=False, uq=False, uk=True, needs_grad=False)
    flags.update({k: kw[k] for k in flags.keys() & kw.keys()})
    extra = {k: v for k, v in kw.items() if k not in flags}
    args = ("bf16", 128, 128, *flags.values(), 0)
    assert compat.plan_key_conflicts(P.PlanKey(*args, **extra)) == ()  # contiguous K/V: nothing refused
    assert compat.plan_key_conflicts(P.PlanKey(*args, paged=True, **extra)) == (name,)
    assert name in compat.CONFLICTS
    assert "compat.plan_key_conflicts(key)" in Path(C.__file__).read_text()  # the sweep asks the table


# ---- sharding --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(GC.CI_SHARDS))
def test_shards_partition_the_worklist_deterministically(arch):
    names = [c.name() for c in G._worklist(None, arch)]
    count = GC.CI_SHARDS[arch]
    shards = [[n for n in names if GC.in_shard(n, i, count)] for i in range(count)]
    assert sorted(sum(shards, [])) == sorted(names)  # every configuration in exactly one shard
    assert all(len(s) < 2 * len(names) / count for s in shards)  # balanced: none twice the mean
    assert GC.in_shard("fwd_bf16_d128v128_128x64w8s2qt", 3, 12) == (
        int(__import__("hashlib").sha256(b"fwd_bf16_d128v128_128x64w8s2qt").hexdigest()[:8], 16) % 12 == 3)
    assert 0 <= GC.ci_shard_index(count) < count


def test_ci_fits_its_time():
    """CI builds one shard of each target per commit: the largest shards of the three together within the gate's
    budget at 2 jobs (5.9 core-seconds a configuration as CI measured), and every full-run target has a shard."""
    assert set(GC.CI_SHARDS) == set(GC.FULL_ARCHS) == {"sm_120a", "sm_80", "sm_121a"}
    biggest = 0
    for arch, n in GC.CI_SHARDS.items():
        names = [c.name() for c in G._worklist(None, arch)]
        biggest += max(sum(GC.in_shard(x, i, n) for x in names) for i in range(n))
    assert biggest * GC.CI_CORE_S_PER_CONFIG / 2 <= GC.CI_GATE_BUDGET_S, biggest
    # sm_120a keeps the share it had before the other targets joined (a ninth)
    assert GC.CI_SHARDS["sm_120a"] == 9 and GC.CI_GATE_BUDGET_S <= 25 * 60


def test_full_runs_cover_every_shipped_compile_target():
    """Every capability build.toml lists, but the test proxy's 9.0 (its GPU tests compile what they run), compiles
    for a target with a committed full run: 8.0 (and 8.6 / 8.9, which load its cubins) sm_80, 12.0 sm_120a, 12.1
    sm_121a."""
    import re

    from flash_attn_4_sm120 import device

    caps = re.search(r"cuda_capabilities = \[([^\]]*)\]", (ROOT / "build.toml").read_text()).group(1)
    shipped = {tuple(int(x) for x in c.strip().strip('"').split(".")) for c in caps.split(",")}
    targets = {device.CAPABILITIES[c].arch for c in shipped if c != (9, 0)}
    assert targets == set(GC.FULL_ARCHS)
    for (major, minor), feat in device.CAPABILITIES.items():  # 8.6 / 8.9 load sm_80 cubins: sm_80's run vouches
        if major == 8:
            assert feat.arch == "sm_80"


def test_ci_checks_every_full_run_and_builds_each_targets_shard(monkeypatch):
    """--ci: each target's full run is checked (a stale one fails CI, naming its target) and each target's shard
    ``HEAD mod N`` is built for that target."""
    import argparse

    built = []
    monkeypatch.setattr(GC, "full_run_problems", lambda arch, names: ["stale"] if arch == "sm_80" else [])
    monkeypatch.setattr(GC, "read_run", lambda path: ({"sources": GC.source_hashes()}, {}))
    monkeypatch.setattr(G, "_gate", lambda work, args, full=None: built.append((args.arch, work)) or 0)
    assert G._ci(argparse.Namespace(ci=True, jobs=2, json=None)) == 1
    assert [a for a, _ in built] == list(GC.FULL_ARCHS)
    for arch, work in built:
        count = GC.CI_SHARDS[arch]
        index = GC.ci_shard_index(count)
        assert work and all(GC.in_shard(c.name(), index, count) for c in work), arch
        whole = [c.name() for c in G._worklist(None, arch)]
        assert len(work) == sum(GC.in_shard(n, index, count) for n in whole)
    # each shard comes from its own target's worklist: no TMA tile for sm_80
    tma_tiles = {a: any(getattr(getattr(c, "tile", None), "tma", False) for c in w) for a, w in built}
    assert not tma_tiles["sm_80"]
    monkeypatch.setattr(GC, "full_run_problems", lambda arch, names: [])
    built.clear()
    assert G._ci(argparse.Namespace(ci=True, jobs=2, json=None)) == 0


def test_shard_index_rotates_with_the_commit():
    counts = {GC.shard_index_of("%08x" % i + "0" * 32, 9) for i in range(9)}
    assert counts == set(range(9))  # nine successive commit prefixes visit every shard of nine
    assert GC.shard_index_of("", 40) == 0
    assert GC.ci_shard_index(48) == GC.shard_index_of(GC._git("rev-parse", "HEAD").stdout.strip(), 48)


def test_changed_kernel_files_pick_their_kinds():
    assert GC.kinds_to_rebuild(["fwd_tma.py"]) == {"fwd_tma"}
    assert GC.kinds_to_rebuild(["fwd_cpasync.py"]) == {"fwd_cpasync", "fwd_decode"}
    assert GC.kinds_to_rebuild(["softmax.py"]) == set(C.KERNEL_FILES)  # shared: everything
    assert GC.kinds_to_rebuild([]) == set()


def test_config_bwd_reaches_only_the_backward_kinds():
    """--refresh rebuilds only gate_ci.CONFIG_KINDS after a config_bwd.py change: true only while every module that
    imports config_bwd is a kernel file of those kinds or host code, and no module every kind reads imports it."""
    import re

    bwd = set(GC.CONFIG_KINDS["config_bwd.py"])
    assert GC.kinds_to_rebuild(["config_bwd.py"]) == bwd
    assert bwd <= set(C.KERNEL_FILES)
    pkg = ROOT / GC.PKG
    pattern = re.compile(r"^\s*(from\s+\.+\s+import\s+[^\n]*\bconfig_bwd\b|from\s+\.+config_bwd\s+import)", re.M)
    importers = {p.name for p in (pkg / "kernels").glob("*.py") if pattern.search(p.read_text())}
    assert importers, "the pattern finds the backward kernels' imports"
    for f in importers:
        owners = {k for k, fs in C.KERNEL_FILES.items() if f in fs}
        assert owners and owners <= bwd, (f, owners)
    for shared in ("config.py", "device.py"):
        assert not pattern.search((pkg / shared).read_text()), shared


def test_every_kernel_file_of_a_kind_exists():
    kdir = ROOT / GC.PKG / "kernels"
    assert all((kdir / f).exists() for fs in C.KERNEL_FILES.values() for f in fs)


def test_every_kernel_file_is_a_kinds_shared_or_excluded():
    """A kernel file listed nowhere counts as shared, so --refresh would rebuild every kind for it: each file under
    kernels/ must be one kind's (or several), shared on purpose, or outside the full runs, and in one group only."""
    kdir = ROOT / GC.PKG / "kernels"
    owned = {f for fs in C.KERNEL_FILES.values() for f in fs}
    excluded = {e.split("/", 1)[1] for e in GC.FULL_RUN_EXCLUDED if e.startswith("kernels/")}
    shared = set(C.SHARED_KERNEL_FILES)
    assert not (owned & shared) and not (owned & excluded) and not (shared & excluded)
    files = {p.name for p in kdir.glob("*.py")}
    assert files == owned | shared | excluded, (sorted(files - owned - shared - excluded),
                                                sorted((owned | shared | excluded) - files))
    assert GC.kinds_to_rebuild(sorted(shared)) == set(C.KERNEL_FILES)


# ---- freshness of the committed full runs ------------------------------------------------------------------
def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", *args], check=True,
                   capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    (tmp_path / GC.PKG / "kernels").mkdir(parents=True)
    (tmp_path / GC.PKG / "kernels" / "fwd_tma.py").write_text("x = 1\n")
    (tmp_path / GC.PKG / "config.py").write_text("T = 1\n")
    (tmp_path / GC.PKG / "interface.py").write_text("f = 1\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "kernels")
    monkeypatch.setattr(GC, "ROOT", tmp_path)
    return tmp_path


def _write_full(repo, rows, commit=True, meta=True, **over):
    path = repo / "benchmarks" / "results" / "gate_full_sm_120a.jsonl"
    head = [{**GC.run_meta("sm_120a", len(rows), 1), "meta": {**GC.run_meta("sm_120a", len(rows), 1)["meta"],
                                                              **over}}] if meta else []
    path.write_text("".join(json.dumps(r) + "\n" for r in head + rows))
    if commit:
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", "full gate")


OK = [{"config": "a", "problems": []}, {"config": "b", "problems": []}]


def test_the_run_records_what_it_built(repo):
    meta = GC.run_meta("sm_120a", 2, 16)["meta"]
    assert meta["arch"] == "sm_120a" and meta["cutlass_dsl"] == GC.cutlass_dsl()[0] != "unknown"
    assert meta["libs"] in ("cu12", "cu13", "cu13+cu12")
    assert len(meta["commit"]) == 40 and meta["dirty"] is False
    # the sources: the kernels and the config tables, not the rest of the package
    assert set(meta["sources"]) == {"kernels/fwd_tma.py", "config.py"}
    assert meta["sources"]["config.py"] == subprocess.run(
        ["git", "-C", str(repo), "rev-parse", f"HEAD:{GC.PKG}/config.py"], capture_output=True,
        text=True).stdout.strip()


def test_full_run_missing_uncommitted_fresh_and_stale(repo):
    names = ["a", "b"]
    assert "is missing" in GC.full_run_problems("sm_120a", names)[0]
    _write_full(repo, OK, commit=False)
    assert "not committed" in GC.full_run_problems("sm_120a", names)[0]
    _write_full(repo, OK)
    assert GC.full_run_problems("sm_120a", names) == []
    (repo / GC.PKG / "interface.py").write_text("f = 2\n")  # not a gate input
    _git(repo, "commit", "-qam", "interface edit")
    assert GC.full_run_problems("sm_120a", names) == []
    # a kernel edit in the working tree: still fresh (HEAD is what the run built), and its kind is rebuilt
    (repo / GC.PKG / "kernels" / "fwd_tma.py").write_text("x = 2\n")
    assert GC.full_run_problems("sm_120a", names) == []
    assert GC.changed_kernel_files(GC.read_run(GC.full_run_path("sm_120a"))[0]) == ["fwd_tma.py"]
    _git(repo, "commit", "-qam", "kernel edit")  # committed: stale
    problems = GC.full_run_problems("sm_120a", names)
    assert len(problems) == 1 and "is stale" in problems[0] and "kernels/fwd_tma.py" in problems[0]
    _write_full(repo, OK)  # a new full run makes it fresh again
    assert GC.full_run_problems("sm_120a", names) == []
    (repo / GC.PKG / "config.py").write_text("T = 2\n")
    _git(repo, "commit", "-qam", "config table edit")
    assert "is stale" in GC.full_run_problems("sm_120a", names)[0]


def test_full_run_record_and_rows_are_checked(repo):
    _write_full(repo, OK, meta=False)
    assert "no record of its run" in GC.full_run_problems("sm_120a", ["a", "b"])[0]
    _write_full(repo, OK, arch="sm_80", cutlass_dsl="0.0")
    problems = GC.full_run_problems("sm_120a", ["a", "b"])
    assert any("made for sm_80" in p for p in problems) and any("nvidia-cutlass-dsl 0.0" in p for p in problems)
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
    monkeypatch.setattr(G, "_gate", lambda work, args, full=None: built.append((args.arch, [c.name() for c in work])) or 0)
    assert G._ci(argparse.Namespace(ci=True, jobs=1, json=None)) == 1
    (arch, names), = built
    index = GC.ci_shard_index(8)
    assert arch == "sm_80" and names and all(GC.in_shard(n, index, 8) for n in names)


def test_ci_adds_the_kinds_changed_since_a_fresh_full_run(monkeypatch):
    import argparse

    built = []
    monkeypatch.setattr(GC, "FULL_ARCHS", ("sm_80",))
    monkeypatch.setattr(GC, "CI_SHARDS", {"sm_80": 8})
    monkeypatch.setattr(GC, "full_run_problems", lambda arch, names: [])
    monkeypatch.setattr(GC, "read_run", lambda path: ({"sources": {}}, {}))
    monkeypatch.setattr(GC, "changed_kernel_files", lambda meta: ["bwd_dq.py"])
    monkeypatch.setattr(G, "_gate", lambda work, args, full=None: built.append(work) or 0)
    assert G._ci(argparse.Namespace(ci=True, jobs=1, json=None)) == 0
    index = GC.ci_shard_index(8)
    (work,) = built
    dq = [c for c in work if C.kind(c) == "dq"]
    assert dq and any(not GC.in_shard(c.name(), index, 8) for c in dq)  # every dQ configuration, not its shard
    assert all(GC.in_shard(c.name(), index, 8) for c in work if C.kind(c) != "dq")


def test_a_json_run_writes_its_record_first(tmp_path, capsys):
    import argparse

    out = tmp_path / "run.jsonl"
    rows = [{"config": "b", "problems": []}, {"config": "a", "problems": ["spills (2 STL/LDL, frame 8 B)"]}]
    G._report(rows, argparse.Namespace(arch="sm_80", jobs=3, json=out))
    meta, read = GC.read_run(out)
    assert meta["arch"] == "sm_80" and meta["configs"] == 2 and meta["jobs"] == 3
    assert meta["sources"] == GC.source_hashes() and "kernels/fwd_tma.py" in meta["sources"]
    assert sorted(read) == ["a", "b"] and read["a"]["problems"]
    assert "1/2 configurations pass for sm_80" in capsys.readouterr().out


def test_targets_without_tma_take_the_tiles_that_do_not_spill_there():
    """sm_80 reroutes (benchmarks/results/gate_spill_probes_sm80_s31.jsonl): paged d256 -> 64x32 two stages, dropout
    d256 -> 64x16, block sparsity with mods at d64 -> Q from shared memory; SM120 (TMA) keeps its tiles; and the
    gate's sm_80 worklist builds the rerouted tiles, not the ones such a device never runs."""
    from flash_attn_4_sm120.config import FwdTile

    flags = ("bf16", 256, 256, False, False, False, False, False, False, True, False, 0)
    assert P.get_plan(P.PlanKey(*flags, paged=True, tma=False)).fwd_cfg.tile == FwdTile(64, 32, 4, 2)
    assert P.get_plan(P.PlanKey(*flags, paged=True, tma=True)).fwd_cfg.tile == FwdTile(64, 64, 4, 1)
    assert P.get_plan(P.PlanKey(*flags, dropout=True, tma=False)).fwd_cfg.tile == FwdTile(64, 16, 4, 1)
    assert P.get_plan(P.PlanKey(*flags, dropout=True, dropout_packed=True, tma=False)).fwd_cfg.tile == FwdTile(64, 16, 4, 1)
    assert P.get_plan(P.PlanKey(*flags, dropout=True, tma=True)).fwd_cfg.tile == FwdTile(64, 32, 4, 1)
    assert config.select_sparse_tile(64, 64, True, mods=True, tma=False) == FwdTile(128, 128, 8, 2)
    names = [c.name() for c in G._worklist(None, "sm_80")]
    assert not [n for n in names if "d256v256_64x64w4s1" in n and "_paged" in n]
    assert not [n for n in names if "d256v256_64x32w4s1" in n and "_drop" in n]
    assert not [n for n in names if "128x128w8s2q" in n and "_sparse" in n and "_mods-" in n]
    assert [n for n in names if "d256v256_64x32w4s2" in n and "_paged" in n and "_win_" in n]


def test_refresh_rebuilds_the_kinds_of_the_changed_kernel_files(tmp_path, monkeypatch):
    """--refresh: a changed config table other than config_bwd.py refuses (a full run is needed); a changed kernel
    file (or config_bwd.py: the backward kinds) rebuilds every configuration of its kinds (stubbed here) plus the
    ones the run lacks, drops rows that left the worklist, and records the refresh with today's source hashes."""
    import argparse

    now = GC.source_hashes()
    work = G._worklist(None, "sm_80")
    dq = [c.name() for c in work if C.kind(c) == "dq"]
    keep = [c.name() for c in work if C.kind(c) != "dq"]
    path = tmp_path / "run.jsonl"

    def write(sources, names):
        meta = {"arch": "sm_80", "sources": sources, "libs": "cu13", "commit": "abc"}
        rows = [{"config": n, "problems": []} for n in names]
        path.write_text("".join(json.dumps(r) + "\n" for r in [{"meta": meta}, *rows]))

    def refuse(*_):
        raise AssertionError("a refused refresh built something")

    monkeypatch.setattr(G, "_run_pool", refuse)
    for table in ("config.py", "device.py", "config_decode.py"):
        write({**now, table: "0" * 40}, keep + dq)
        assert G._refresh(argparse.Namespace(refresh=path, jobs=1, arch="sm_80")) == 2, table
    built = []
    monkeypatch.setattr(G, "_run_pool", lambda w, args: built.extend(w) or [
        {"config": c.name(), "problems": ["spills (2 STL/LDL, frame 8 B)"] if c.name() == dq[0] else []} for c in w])
    write({**now, "config_bwd.py": "0" * 40}, keep + dq)  # the backward kinds, stubbed
    assert G._refresh(argparse.Namespace(refresh=path, jobs=1, arch="sm_80")) == 1
    assert {C.kind(c) for c in built} == set(GC.CONFIG_KINDS["config_bwd.py"]) & {C.kind(c) for c in work}
    built.clear()
    write({**now, "kernels/bwd_dq.py": "0" * 40}, keep[1:] + dq + ["gone_config"])
    assert G._refresh(argparse.Namespace(refresh=path, jobs=1, arch="sm_80")) == 1  # the stubbed spill fails it
    assert sorted(c.name() for c in built) == sorted(dq + keep[:1])  # the dQ kind + the row the run lacked
    meta, rows = GC.read_run(path)
    assert meta["sources"] == now and "gone_config" not in rows and len(rows) == len(work)
    (ref,) = meta["refreshes"]
    assert ref["files"] == ["bwd_dq.py"] and ref["kinds"] == ["dq"] and ref["rebuilt"] == len(dq) + 1
    assert ref["dropped"] == 1 and rows[dq[0]]["libs"]


def test_ci_passes_a_spill_of_one_toolchain_only(monkeypatch, capsys):
    """Under --ci a shard configuration that spills with CI's libs passes when the committed full run (other libs)
    built it clean, and says so; a spill the full run also had, another problem, or no full-run row fails."""
    import argparse

    _, libs = GC.cutlass_dsl()
    other = "cu13" if libs != "cu13" else "cu12"
    spill = {"config": "a", "problems": ["spills (3 STL/LDL, frame 8 B)"]}
    monkeypatch.setattr(G, "_run_pool", lambda work, args: [dict(spill)])
    monkeypatch.setattr(G, "_report", lambda rows, args: None)
    args = argparse.Namespace(arch="sm_120a", jobs=1, json=None)
    assert G._gate(["w"], args, {"a": {"problems": [], "libs": other}}) == 0
    assert "spills only with" in capsys.readouterr().out
    assert G._gate(["w"], args, {"a": {"problems": [], "libs": libs}}) == 1  # same libs: a real failure
    assert G._gate(["w"], args, {"a": {"problems": ["spills (1 STL/LDL, frame 8 B)"], "libs": other}}) == 1
    assert G._gate(["w"], args, {}) == 1
    assert G._gate(["w"], args) == 1
    monkeypatch.setattr(G, "_run_pool", lambda work, args: [{"config": "a", "problems": ["no HMMA"]}])
    assert G._gate(["w"], args, {"a": {"problems": [], "libs": other}}) == 1
