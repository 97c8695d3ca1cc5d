"""SM120 compile gate: build every kernel configuration (forward and backward) the dispatcher can select for
sm_120a on a CPU (fake tensors, no GPU) and check its SASS.

    python scripts/compile_gate.py                 # all configurations, table on stdout, exit 1 on a failure
    python scripts/compile_gate.py --limit 1       # first configuration only (smoke)
    python scripts/compile_gate.py --filter d128   # configurations whose name contains "d128"
    python scripts/compile_gate.py --arch sm_90a   # same check for another target
    python scripts/compile_gate.py --arch sm_121a  # SM121 (DGX Spark): what jit.target_arch compiles on a 12.1 device
                                                   # (sm_120f, the family target, builds too)
    python scripts/compile_gate.py --arch sm_80    # the target without TMA (8.0, 8.6 and 8.9 devices): cp.async
    python scripts/compile_gate.py --ci            # CI: every committed full run's checks and one shard of each
                                                   # target (sm_120a, sm_80, sm_121a: gate_ci.py)
    # the full runs to commit, one per target of gate_ci.FULL_ARCHS (outside a git checkout, FA4_GATE_COMMIT=<sha>
    # names the commit in its record):
    python scripts/compile_gate.py --arch sm_120a --jobs 16 --json benchmarks/results/gate_full_sm_120a.jsonl
    python scripts/compile_gate.py --arch sm_80 --jobs 16 --json benchmarks/results/gate_full_sm_80.jsonl
    python scripts/compile_gate.py --arch sm_121a --jobs 16 --json benchmarks/results/gate_full_sm_121a.jsonl

A configuration passes when its cubin has HMMA (mma.sync) instructions (the attention kernels; the split-KV
combine and the backward preprocess kernels have no matmul and must have none), none of the instructions SM120 lacks
(wgmma/GMMA, UTC*/tcgen05, 2-CTA TMA), no spills (STL/LDL, stack frame 0), and its dynamic shared memory is
at most 101376 B.  Configurations are (dtype, head_dim, head_dim_v, tile) from the tile tables, each at its
lightest and heaviest feature set: the hand-made worklists of scripts/gate_lists.py (per tile, paged, block-sparse,
decode, backward, dropout, fused backward, combine, backward preprocess and the library mods), plus, unless
--no-classes, every class the dispatcher can select at its lightest and heaviest flag set (scripts/gate_classes.py).
--json writes the rows and a first line that records the run (target, CuTe-DSL version and libs, commit, the
fingerprint of the sources the gate builds; scripts/gate_ci.py).  Each row carries ``sass_sha256``, the digest of its
normalised SASS (sass_check.sass_digest; rows of older runs lack it): ``scripts/sass_compare.py --rows A B`` compares
two runs configuration by configuration.

The target without TMA (sm_80, which 8.6 and 8.9 devices load too: device.CAPABILITIES) builds what such a device selects: every TMA tile
replaced by the cp.async tile of its row, no split-KV forward and no combine kernel (both use griddepcontrol, which
needs sm_90), and fail on any TMA, mbarrier-tx or setmaxnreg instruction (sass_check.FORBIDDEN_WITHOUT_TMA).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # scripts.* (sass_check, gate_classes, gate_ci)


def _package():
    """Import the bundle from torch-ext/ (the gate checks the sources, before any build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "flash_attn_4_sm120", ROOT / "torch-ext" / "flash_attn_4_sm120" / "__init__.py",
        submodule_search_locations=[str(ROOT / "torch-ext" / "flash_attn_4_sm120")],
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flash_attn_4_sm120"] = mod
    spec.loader.exec_module(mod)
    return mod


_BWD_FLAGS = ("windowed", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k", "has_dropout",
              "dropout_seed_tensor", "sparse_q_ratio", "sparse_kv_ratio", "mods")


def _bwd_without_tma(cfg):
    """A dK/dV or dQ configuration the TMA selection gives for its flags -> the one a device without TMA selects
    for them (config_bwd's sm_80 spill sets), or None where such a device refuses the call; any other (a tile the
    hand-made lists build on purpose) as it is."""
    from flash_attn_4_sm120 import config_bwd

    if cfg.fused_dq:
        return cfg
    flags = {f: getattr(cfg, f) for f in _BWD_FLAGS}
    if isinstance(cfg, config_bwd.DqKernelConfig):
        select, flags = config_bwd.select_dq_config, dict(flags, sink_grad=cfg.sink_grad)
    else:
        select = config_bwd.select_bwd_config
    try:
        if select(cfg.dtype, cfg.head_dim, cfg.head_dim_v, **flags) != cfg:
            return cfg
        return select(cfg.dtype, cfg.head_dim, cfg.head_dim_v, False, **flags)
    except ValueError:
        return None


def _without_tma(cfg):
    """The configuration a device without TMA runs where ``cfg`` was selected for a TMA target: for a TMA tile the
    cp.async tile the same selection gives without TMA (the same row of the tile table; for block sparsity the
    tile of the same block size, with its ratios); for the tiles that spill on sm_80 with some feature set, the
    one config.py / config_bwd.py select there instead; None where such a device refuses the call (score/mask mods
    with dropout at d <= 128, the block-sparse backward feature sets of compat "sparse_grad_without_tma").  Other
    configurations are returned as they are."""
    from dataclasses import replace

    from flash_attn_4_sm120 import config, config_bwd

    if isinstance(cfg, config_bwd.BwdKernelConfig):
        return _bwd_without_tma(cfg)
    if not isinstance(cfg, config.FwdKernelConfig):
        return cfg
    d, dv, tile = cfg.head_dim, cfg.head_dim_v, cfg.tile
    if cfg.mods is not None and cfg.has_dropout and not tile.tma:
        try:
            if tile == config.mods_dropout_fwd_tile(d, dv):
                return replace(cfg, tile=config.mods_dropout_fwd_tile(d, dv, tma=False))
        except ValueError:
            pass
        return cfg
    plain = not (cfg.split_kv or cfg.block_sparse or tile.kv_groups > 1 or cfg.mods is not None)
    if not tile.tma and plain and cfg.paged:  # a paged prefill tile: the one such a device picks for paged K/V
        rows = [w for w in (False, True) if tile == config.select_fwd_tile(d, dv, w, paged=True)]
        if rows and tile in config.candidate_tiles(d, dv, rows[0], paged=True):
            return replace(cfg, tile=config.select_fwd_tile(d, dv, rows[0], paged=True, tma=False))
        return cfg
    if not tile.tma and plain and cfg.has_dropout:  # a cp.async dropout tile: the same choice without TMA
        rows = [w for w in (False, True) if tile == config.dropout_fwd_tile(d, dv, config.select_fwd_tile(d, dv, w))]
        if rows:
            new = config.select_fwd_tile(d, dv, rows[0], tma=False)
            return replace(cfg, tile=config.dropout_fwd_tile(d, dv, new, tma=False))
        return cfg
    if not tile.tma:
        return cfg
    if cfg.mods is not None and cfg.has_dropout:
        try:
            return replace(cfg, tile=config.mods_dropout_fwd_tile(d, dv, tma=False))
        except ValueError:
            return None
    if cfg.block_sparse:
        block = (tile.tile_m * cfg.sparse_q_ratio, tile.tile_n * cfg.sparse_kv_ratio)
        new = config.select_sparse_tile(d, dv, cfg.windowed, mods=cfg.mods is not None, block_size=block, tma=False)
        if cfg.mods is not None:
            new = config.mods_tile(new, d, dv)
        return replace(cfg, tile=new, sparse_q_ratio=block[0] // new.tile_m, sparse_kv_ratio=block[1] // new.tile_n)
    rows = [w for w in (False, True) if tile in config.candidate_tiles(d, dv, w)]
    new = config.select_fwd_tile(d, dv, rows[0] if rows else cfg.windowed, tma=False)
    if cfg.has_dropout:
        new = config.dropout_fwd_tile(d, dv, new, tma=False)
    if cfg.mods is not None:
        new = config.mods_tile(new, d, dv)
    return replace(cfg, tile=new)


def _worklist(pattern: str | None, arch: str = "sm_120a", classes: bool = True):
    """The configurations the gate builds for ``arch``: those a device of that target selects (device.py's table:
    without TMA the cp.async tiles, ``_without_tma``; without programmatic dependent launch no split-KV forward
    and no combine kernel).  ``classes``: also every class the dispatcher can select, at its lightest and heaviest
    flag set (scripts/gate_classes.py); without it, the hand-made worklists only."""
    _package()
    from flash_attn_4_sm120 import config_bwd, config_combine, device
    from scripts.gate_lists import hand_worklist

    items = hand_worklist()
    feat = device.features_of_arch(arch)
    if classes:
        from scripts.gate_classes import class_worklist

        items += class_worklist(feat.tma, feat.pdl, feat.red_f32x2)
    if not feat.tma:
        items = [c for c in map(_without_tma, items) if c is not None]
    if not feat.red_f32x2:  # the fused backward's dQ adds need red.global.add.v2.f32: the kernel pair runs there
        items = [c for c in items if not getattr(c, "fused_dq", False)
                 and not isinstance(c, config_bwd.DqConvertKernelConfig)]
    if not feat.pdl:
        items = [c for c in items if not getattr(c, "split_kv", False)
                 and not isinstance(c, config_combine.CombineKernelConfig)]
    seen, unique = set(), []
    for c in items:  # worklists may overlap (e.g. a heaviest set that is also a subset of a sweep)
        if c.name() not in seen:
            seen.add(c.name())
            unique.append(c)
    return [c for c in unique if pattern is None or pattern in c.name()]


def _check_one(cfg, arch: str) -> dict:
    """Runs in a worker process: compile for ``arch`` and inspect the cubin."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    # CuTe-DSL reads the dump folder once per process: one folder per worker, under main()'s, removed at the end
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(dir=os.environ.get("FA4_GATE_DUMP_PARENT")))
    _package()
    sys.path.insert(0, str(ROOT))
    from flash_attn_4_sm120 import config, config_bwd, config_combine, device, jit
    from scripts.sass_check import inspect_cubin

    t0 = time.time()
    row = {"config": cfg.name(), "arch": arch}
    try:
        fn, kernel = jit.compile_kernel(cfg, with_kernel=True)
        # elementwise / reductions: no matmul
        no_mma = isinstance(cfg, (config_combine.CombineKernelConfig, config_bwd.BwdPreKernelConfig,
                                  config_bwd.DqConvertKernelConfig))
        if isinstance(cfg, config_combine.CombineKernelConfig):
            expected_smem = config_combine.combine_smem_bytes(cfg)
        elif no_mma:
            expected_smem = 0
        elif isinstance(cfg, config_bwd.DqKernelConfig):
            expected_smem = config_bwd.dq_smem_bytes(cfg)
        elif isinstance(cfg, config_bwd.BwdKernelConfig):
            expected_smem = config_bwd.bwd_smem_bytes(cfg)
        else:
            expected_smem = config.fwd_smem_bytes(cfg.head_dim, cfg.head_dim_v, cfg.tile)
        cubin = fn.__cubin__
        if isinstance(cubin, str):
            cubin = Path(cubin).read_bytes()
        rep = inspect_cubin(cubin)
        row.update(
            compile_s=round(time.time() - t0, 1), regs=rep.registers, frame=rep.frame_bytes, spills=rep.spills,
            hmma=rep.counts["HMMA"], ex2=rep.counts["MUFU.EX2"], smem=kernel.launch_smem_bytes,
            cubin_arch=rep.arch, forbidden=rep.forbidden, sass_sha256=rep.sass_sha256,
        )
        problems = []
        if rep.counts["HMMA"] == 0 and not no_mma:
            problems.append("no HMMA")
        if rep.counts["HMMA"] and no_mma:
            problems.append("HMMA in a kernel without matmul")
        if rep.forbidden:
            problems.append("forbidden: " + ",".join(rep.forbidden))
        if rep.tma_ops and not device.features_of_arch(arch).tma:
            problems.append("TMA / mbarrier-tx / setmaxnreg on a target without them: " + ",".join(rep.tma_ops))
        if rep.spills or rep.frame_bytes:
            problems.append(f"spills ({rep.spills} STL/LDL, frame {rep.frame_bytes} B)")
        if kernel.launch_smem_bytes > config.SMEM_LIMIT_BYTES:
            problems.append(f"smem {kernel.launch_smem_bytes} > {config.SMEM_LIMIT_BYTES}")
        if kernel.launch_smem_bytes != expected_smem:
            problems.append(f"smem {kernel.launch_smem_bytes} differs from the config's {expected_smem}")
        if isinstance(cfg, config.FwdKernelConfig) and cfg.tile.tma:
            # setmaxnreg only moves registers inside the pool the CTA was launched with: an increase the pool
            # cannot cover waits forever (mma warps + the 4-warp producer group)
            mma = cfg.tile.num_threads
            if not (rep.maxreg_alloc and rep.maxreg_dealloc):
                problems.append("no setmaxnreg in the TMA kernel")
            else:
                need = mma * max(rep.maxreg_alloc) + 128 * max(rep.maxreg_dealloc)
                pool = rep.registers * (mma + 128)
                if need > pool:
                    problems.append(f"setmaxnreg needs {need} registers, the CTA's pool has {pool} (deadlock)")
        if not rep.arch.startswith(arch.rstrip("af")):
            problems.append(f"cubin is {rep.arch}, expected {arch}")
        row["problems"] = problems
    except Exception as exc:  # report, never hide, a compile failure
        row.update(compile_s=round(time.time() - t0, 1), problems=[f"compile failed: {type(exc).__name__}: {exc}"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_120a")
    ap.add_argument("--limit", type=int, default=None, help="check only the first N configurations")
    ap.add_argument("--filter", default=None, help="substring of the configuration name")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON lines")
    ap.add_argument("--shard", default=None, help="I/N: only the configurations of shard I of N (by name hash)")
    ap.add_argument("--no-classes", action="store_true", help="the hand-made worklists only (no class sweep)")
    ap.add_argument("--ci", action="store_true", help="CI: check the committed full runs, build a shard and what "
                    "changed since the full run (scripts/gate_ci.py)")
    ap.add_argument("--recheck", type=Path, default=None, help="a full run's JSON lines: rebuild its failing "
                    "configurations here (CI's libs) and record the result in each row's 'recheck'")
    ap.add_argument("--refresh", type=Path, default=None, help="a full run's JSON lines whose kernel files changed "
                    "since it was made (and no config table or device.py): rebuild every configuration of the kernel "
                    "kinds those files touch (the rule --ci applies, gate_ci.kinds_to_rebuild) plus any new one, "
                    "and record the refresh in the run's record")
    args = ap.parse_args(argv)
    if args.ci:
        return _ci(args)
    if args.recheck:
        return _recheck(args)
    if args.refresh:
        return _refresh(args)

    work = _worklist(args.filter, args.arch, not args.no_classes)
    if args.shard is not None:
        from scripts.gate_ci import in_shard

        try:
            index, count = (int(x) for x in args.shard.split("/"))
        except ValueError:
            index, count = -1, 0
        if not 0 <= index < count:
            print(f"compile gate: --shard must be I/N with 0 <= I < N, got {args.shard!r}", file=sys.stderr)
            return 2
        work = [c for c in work if in_shard(c.name(), index, count)]
    if args.limit is not None:
        work = work[: args.limit]
    return _gate(work, args)


def _refresh(args) -> int:
    """Bring a full run up to date after a change of kernel files only: every configuration of the kinds the
    changed files touch (``gate_ci.kinds_to_rebuild``, the rule by which --ci rebuilds changed classes) and every
    configuration of today's worklist the run lacks is rebuilt here; rows that left the worklist are dropped.  The
    run's record gets today's source hashes and a ``refreshes`` entry (commit, libs, files, kinds, count); each
    rebuilt row carries ``libs``.  A changed config_bwd.py rebuilds the backward kinds it feeds
    (``gate_ci.CONFIG_KINDS``); any other changed config table or device.py changes what every kind selects: that
    needs a full run, and this refuses."""
    from scripts import gate_ci as GC
    from scripts.gate_classes import kind

    lines = [json.loads(line) for line in args.refresh.read_text().splitlines() if line.strip()]
    meta = next((r["meta"] for r in lines if "meta" in r), None)
    if meta is None:
        print(f"compile gate --refresh: {args.refresh} has no run record", file=sys.stderr)
        return 2
    now = GC.source_hashes()
    changed = GC._differing(now, meta.get("sources", {}))
    other = [c for c in changed if not c.startswith("kernels/") and c not in GC.CONFIG_KINDS]
    if other:
        print(f"compile gate --refresh: {', '.join(other)} changed since the run: make a full run", file=sys.stderr)
        return 2
    files = sorted({Path(c).name for c in changed})
    kinds = GC.kinds_to_rebuild(files) if files else set()
    arch = meta["arch"]
    rows = {r["config"]: r for r in lines if "config" in r}
    work_all = _worklist(None, arch)
    work = [c for c in work_all if kind(c) in kinds or c.name() not in rows]
    _, libs = GC.cutlass_dsl()
    args.arch = arch
    for r in _run_pool(work, args) if work else []:
        rows[r["config"]] = {**r, "libs": libs}
    names = [c.name() for c in work_all]
    head = GC._git("rev-parse", "HEAD")
    commit = os.environ.get("FA4_GATE_COMMIT") or (head.stdout.strip() if head.returncode == 0 else "unknown")
    meta["sources"] = now
    meta["configs"] = len(names)
    dropped = len(set(rows) - set(names))
    if work or dropped:  # a refresh that changed nothing is not recorded
        meta.setdefault("refreshes", []).append({"commit": commit, "libs": libs, "files": files,
                                                 "kinds": sorted(kinds), "rebuilt": len(work), "dropped": dropped})
    out = [{"meta": meta}] + [rows[n] for n in names if n in rows]
    args.refresh.write_text("".join(json.dumps(r) + "\n" for r in out))
    failing = sorted(n for n in names if n in rows and not GC.row_passes(rows[n]))
    print(f"compile gate --refresh {arch}: {len(files)} kernel/config files changed ({', '.join(files) or 'none'}), "
          f"{len(work)} configurations rebuilt with {libs}; {len(failing)} failing"
          + (f": {', '.join(failing[:5])}" if failing else ""))
    return 1 if failing else 0


def _recheck(args) -> int:
    """Rebuild the failing configurations of a full run (built elsewhere, e.g. with the GPU machine's cu13 libs)
    with this environment's libs; each row gains ``recheck`` = {libs, problems, regs, spills}, the run's record
    ``recheck_libs``.  The file is rewritten in place; the original verdict stays in the row."""
    from scripts import gate_ci as GC

    lines = [json.loads(line) for line in args.recheck.read_text().splitlines() if line.strip()]
    meta = next((r["meta"] for r in lines if "meta" in r), {})
    failing = {r["config"] for r in lines if "config" in r and r.get("problems")}
    work = [c for c in _worklist(None, meta.get("arch", args.arch)) if c.name() in failing]
    rows = {r["config"]: r for r in _run_pool(work, args)} if work else {}
    _, libs = GC.cutlass_dsl()
    for r in lines:
        if "meta" in r:
            r["meta"]["recheck_libs"] = libs
        elif r.get("config") in rows:
            got = rows[r["config"]]
            r["recheck"] = {"libs": libs, "problems": got["problems"], "regs": got.get("regs"),
                            "spills": got.get("spills")}
    args.recheck.write_text("".join(json.dumps(r) + "\n" for r in lines))
    still = sorted(n for n, r in rows.items() if r["problems"])
    print(f"compile gate --recheck: {len(rows)} failing configurations rebuilt with {libs}; "
          f"{len(rows) - len(still)} pass there" + (f"; still failing: {', '.join(still)}" if still else ""))
    return 1 if still or len(rows) != len(failing) else 0


def _ci(args) -> int:
    """CI's gate: every committed full run must vouch for today's worklist (gate_ci.full_run_problems); then build
    each CI_SHARDS target's shard plus the configurations whose kernel kind changed since its full run."""
    from argparse import Namespace

    from scripts import gate_ci as GC
    from scripts.gate_classes import kind

    stale, status = [], 0
    for arch in GC.FULL_ARCHS:
        work = _worklist(None, arch)
        problems = GC.full_run_problems(arch, [c.name() for c in work])
        stale += [f"{arch}: {p}" for p in problems]
        count = GC.CI_SHARDS.get(arch)
        if count is None:
            continue
        index = GC.ci_shard_index(count)
        # with a stale or missing full run CI fails anyway: the shard only, not "everything changed" (hours)
        changed = set() if problems else GC.kinds_to_rebuild(GC.changed_kernel_files(
            GC.read_run(GC.full_run_path(arch))[0]))
        todo = [c for c in work if GC.in_shard(c.name(), index, count) or kind(c) in changed]
        print(f"compile gate --ci {arch}: shard {index}/{count} and the kinds changed since the full run "
              f"({', '.join(sorted(changed)) or 'none'}): {len(todo)} of {len(work)} configurations", flush=True)
        meta, rows = ({}, {}) if problems else GC.read_run(GC.full_run_path(arch))
        full = {n: {**r, "libs": r.get("libs") or (meta or {}).get("libs")} for n, r in rows.items()}
        status |= _gate(todo, Namespace(**{**vars(args), "arch": arch}), full)
    for line in stale:
        print(f"compile gate --ci: FULL RUN {line}", file=sys.stderr)
    return 1 if stale else status


def _gate(work, args, full: dict | None = None) -> int:
    """Build ``work`` and fail on any problem, except (``full``: the rows of a fresh committed full run, under
    --ci) a spill where the full run, made with the other CuTe-DSL libs, built the same configuration clean: a
    spill of one toolchain only, which passes as the full run's spills of its own libs pass when CI's rebuild them
    clean (gate_ci.row_passes), and is printed as such.  Anything else, and a spill with both, fails."""
    if not work:
        print("compile gate: no configuration matches", file=sys.stderr)
        return 2
    print(f"compile gate: {len(work)} configurations for {args.arch}, {args.jobs} jobs", flush=True)
    rows = []
    dump_parent = tempfile.mkdtemp(prefix="fa4sm120_gate_")
    os.environ["FA4_GATE_DUMP_PARENT"] = dump_parent  # workers inherit it
    try:
        rows = _run_pool(work, args)
    finally:
        shutil.rmtree(dump_parent, ignore_errors=True)
    _report(rows, args)
    bad = [r for r in rows if r["problems"]]
    if full:
        from scripts import gate_ci as GC

        _, libs = GC.cutlass_dsl()
        one = [r for r in bad if _one_toolchain_spill(r, full.get(r["config"]), libs)]
        for r in one:
            got = full[r["config"]]
            print(f"compile gate: {r['config']} spills only with {libs} ({r['problems'][0]}); the full run built "
                  f"it clean with {got.get('libs') or 'its libs'}: a spill of one toolchain, passed", flush=True)
        bad = [r for r in bad if r not in one]
    return 1 if bad else 0


def _one_toolchain_spill(row: dict, full_row: dict | None, libs: str) -> bool:
    """Whether ``row`` (built here with ``libs``) fails only by spilling while ``full_row`` (the committed full
    run's row of the same configuration, built with other libs) passed clean."""
    if full_row is None or full_row.get("problems") or (full_row.get("libs") or "") == libs:
        return False
    return all(p.startswith("spills (") for p in row["problems"])


def _run_pool(work, args) -> list[dict]:
    rows = []
    with cf.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {pool.submit(_check_one, cfg, args.arch): cfg for cfg in work}
        for fut in cf.as_completed(futs):
            rows.append(fut.result())
            r = rows[-1]
            print(f"  {'ok  ' if not r['problems'] else 'FAIL'} {r['config']} ({r.get('compile_s', '?')} s)", flush=True)
    return rows


def _report(rows: list[dict], args) -> None:
    rows.sort(key=lambda r: r["config"])
    hdr = f"| {'configuration':<58} | regs | spills | frame | HMMA | EX2 | smem (B) | result |"
    print("\n" + hdr + "\n|" + "|".join("-" * (len(c) + 0) for c in hdr.split("|")[1:-1]) + "|")
    for r in rows:
        res = "ok" if not r["problems"] else "; ".join(r["problems"])
        print(
            f"| {r['config']:<58} | {r.get('regs', '-'):>4} | {r.get('spills', '-'):>6} | {r.get('frame', '-'):>5} "
            f"| {r.get('hmma', '-'):>4} | {r.get('ex2', '-'):>3} | {r.get('smem', '-'):>8} | {res} |"
        )
    if args.json:  # the run's record first (scripts/gate_ci.py reads it), then one row per configuration
        from scripts.gate_ci import run_meta

        meta = run_meta(args.arch, len(rows), args.jobs)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in [meta, *rows]))
    bad = [r for r in rows if r["problems"]]
    print(f"\ncompile gate: {len(rows) - len(bad)}/{len(rows)} configurations pass for {args.arch}")


if __name__ == "__main__":
    sys.exit(main())
