"""Compile gate of the FP8 forward (kernels/fwd_fp8.py) on a CPU: every config_fp8.all_configs() entry for the
given arch, with its SASS checked.

Checks: the FP8 mma instruction is in the SASS (``QMMA.16832.F32.E4M3.E4M3`` on sm_120a; on sm_90a ptxas lowers
``mma.sync ... e4m3`` to e4m3->f16 unpacks plus ``HMMA.16816.F32``, which is recorded, not refused: the H100 proxy
has no mma.sync FP8 unit), no bf16 mma (``HMMA`` with ``BF16``), 0 spills, no forbidden opcode, shared memory equal
to ``config_fp8.smem_bytes`` and within 101376 B.

    CUTE_DSL_ARCH is set from --arch; one compile at a time (a few seconds each):
    .venv/bin/python scripts/gate_fp8.py --arch sm_120a --out benchmarks/results/fp8_gate_sm120a.jsonl
    .venv/bin/python scripts/gate_fp8.py --ci      # CI (scripts/test.sh): sm_120a, shard HEAD mod FP8_CI_SHARDS
    .venv/bin/python scripts/gate_fp8.py --arch sm_90a --filter _pack_   # a substring of the config names only
    .venv/bin/python scripts/gate_fp8.py --skip _paged_   # all but those holding a substring
    .venv/bin/python scripts/gate_fp8.py --arch sm_90a --jobs 16 --out ...   # 16 compiles at a time (many cores)

The full worklist is 904 configurations (config_fp8.all_configs: 64 dense/varlen, 32 packed GQA, 32 split-KV, 48
with the packed decode tile, the 144 varlen ones again with paged K/V, the 288 varlen ones again with a
bf16/fp16 query quantized in the kernel: 96 unsplit x 2 (q_dtype = out_dtype) + 48 split x 2 x 2, and 200 of
those 704 again with softcap, config_fp8.softcap_subset; ``--filter _softcap_`` builds those); on the 2-core
CPU machine one compile took 3-9 s alone and ~11 s beside other work, so a full run is hours there and CI builds a
rotating thirty-second (gate_ci.in_shard: the same name hash as the main gate's shards; successive commits cover every
configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MMA_RE = r"\b([QHO]MMA\.[A-Z0-9_.]+)"
# 904 configurations: a thirty-second (~28 compiles; ~22 before softcap's 200) keeps CI's FP8 share near where a
# sixteenth of 320 had it, the 2.5 minutes a quarter of 64 took (benchmarks/results/fp8_gate_sm120a_ci_shard0_cpu.jsonl)
FP8_CI_SHARDS = 32


def _setup_env(arch: str, own_dump_dir: bool = False) -> None:
    """The compile environment; ``own_dump_dir``: a --jobs worker keeps its kept cubins in a directory of its own."""
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    if own_dump_dir:
        os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp()
    else:
        os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp())
    for p in (str(ROOT / "torch-ext"), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)


def _build(cfg, arch: str) -> dict:
    """Compile one configuration for ``arch`` and check its SASS -> the gate's row (problems empty: pass)."""
    from flash_attn_4_sm120 import config_fp8
    from flash_attn_4_sm120.dispatch_fp8 import compile_fp8
    from scripts.sass_check import disassemble, inspect_cubin

    t0 = time.time()
    row = {"config": cfg.name(), "arch": arch}
    try:
        fn, kernel = compile_fp8(cfg, with_kernel=True)
        cubin = fn.__cubin__
        cubin = Path(cubin).read_bytes() if isinstance(cubin, str) else cubin
        rep = inspect_cubin(cubin)
        sass = disassemble(cubin)
        mma = sorted(set(re.findall(MMA_RE, sass)))
        row.update(compile_s=round(time.time() - t0, 1), regs=rep.registers, frame=rep.frame_bytes,
                   spills=rep.spills, smem=kernel.launch_smem_bytes, mma=mma,
                   n_mma=len(re.findall(MMA_RE, sass)), e4m3_unpacks=len(re.findall(r"F2FP\.F16\.E4M3", sass)),
                   cubin_arch=rep.arch, forbidden=rep.forbidden)
        problems = []
        fp8_native = any(m.startswith("QMMA.") and "E4M3" in m for m in mma)
        if arch.startswith("sm_12") and not fp8_native:
            problems.append(f"no QMMA e4m3 in the SASS ({mma})")
        if not mma:
            problems.append("no mma in the SASS")
        if any("BF16" in m for m in mma):
            problems.append(f"bf16 mma in the SASS ({mma})")
        if rep.spills or rep.frame_bytes:
            problems.append(f"spills ({rep.spills} STL/LDL, frame {rep.frame_bytes} B)")
        if rep.forbidden:
            problems.append("forbidden: " + ",".join(rep.forbidden))
        if kernel.launch_smem_bytes != config_fp8.smem_bytes(cfg):
            problems.append(f"smem {kernel.launch_smem_bytes} != config's {config_fp8.smem_bytes(cfg)}")
        if kernel.launch_smem_bytes > config_fp8.SMEM_LIMIT:
            problems.append(f"smem {kernel.launch_smem_bytes} > {config_fp8.SMEM_LIMIT}")
        row["problems"] = problems
    except Exception as exc:  # report, never hide, a compile failure
        row.update(compile_s=round(time.time() - t0, 1), problems=[f"compile failed: {type(exc).__name__}: {exc}"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_120a")
    ap.add_argument("--filter", default="", help="substring of the config name")
    ap.add_argument("--skip", default=None, help="leave out the configurations whose name holds this substring")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shard", default=None, help="I/N: only the configurations of shard I of N (by name hash)")
    ap.add_argument("--ci", action="store_true", help=f"CI: sm_120a, shard (HEAD mod {FP8_CI_SHARDS})")
    ap.add_argument("--jobs", type=int, default=1, help="compiles at a time (worker processes; rows keep the "
                    "worklist's order)")
    args = ap.parse_args(argv)
    shard = None
    if args.ci:
        args.arch = "sm_120a"
    if args.shard is not None or args.ci:
        sys.path[:0] = [str(ROOT)]
        from scripts import gate_ci as GC

        if args.ci:
            shard = (GC.ci_shard_index(FP8_CI_SHARDS), FP8_CI_SHARDS)
        else:
            try:
                shard = tuple(int(x) for x in args.shard.split("/"))
                if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
                    raise ValueError
            except ValueError:
                print(f"gate_fp8: --shard must be I/N with 0 <= I < N, got {args.shard!r}", file=sys.stderr)
                return 2
    _setup_env(args.arch)
    from flash_attn_4_sm120 import config_fp8

    work = [cfg for cfg in config_fp8.all_configs()
            if args.filter in cfg.name() and not (args.skip and args.skip in cfg.name())
            and (shard is None or GC.in_shard(cfg.name(), *shard))]
    if args.jobs > 1:
        import concurrent.futures as cf
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no CuTe-DSL state shared across forks
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_setup_env,
                                    initargs=(args.arch, True)) as pool:
            results = pool.map(_build, work, [args.arch] * len(work))
            rows = []
            for row in results:
                print(json.dumps(row), flush=True)
                rows.append(row)
    else:
        rows = []
        for cfg in work:
            row = _build(cfg, args.arch)
            print(json.dumps(row), flush=True)
            rows.append(row)
    failed = sum(bool(r["problems"]) for r in rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    where = f" (shard {shard[0]}/{shard[1]})" if shard is not None else ""
    print(f"{len(rows) - failed}/{len(rows)} FP8 configurations pass for {args.arch}{where}")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
