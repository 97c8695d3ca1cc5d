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

The full worklist is 320 configurations (config_fp8.all_configs: 64 dense/varlen, 32 packed GQA, 32 split-KV, 48
with the packed decode tile, and the 144 varlen ones again with paged K/V); on the 2-core CPU machine one compile
took 3-9 s, so the full sm_120a run is 25-45 minutes there and CI builds a rotating sixteenth (gate_ci.in_shard:
the same name hash as the main gate's shards; successive commits cover every configuration).
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
FP8_CI_SHARDS = 16  # 320 configurations: a sixteenth keeps CI's FP8 share near the 2.5 minutes a quarter of 64 took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_120a")
    ap.add_argument("--filter", default="", help="substring of the config name")
    ap.add_argument("--skip", default=None, help="leave out the configurations whose name holds this substring")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shard", default=None, help="I/N: only the configurations of shard I of N (by name hash)")
    ap.add_argument("--ci", action="store_true", help=f"CI: sm_120a, shard (HEAD mod {FP8_CI_SHARDS})")
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
    os.environ["CUTE_DSL_ARCH"] = args.arch
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp())
    sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]
    from flash_attn_4_sm120 import config_fp8
    from flash_attn_4_sm120.dispatch_fp8 import compile_fp8
    from scripts.sass_check import disassemble, inspect_cubin

    rows, failed = [], 0
    for cfg in config_fp8.all_configs():
        if (args.filter not in cfg.name() or (args.skip and args.skip in cfg.name())
                or (shard is not None and not GC.in_shard(cfg.name(), *shard))):
            continue
        t0 = time.time()
        row = {"config": cfg.name(), "arch": args.arch}
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
            if args.arch.startswith("sm_12") and not fp8_native:
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
        failed += bool(row["problems"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    where = f" (shard {shard[0]}/{shard[1]})" if shard is not None else ""
    print(f"{len(rows) - failed}/{len(rows)} FP8 configurations pass for {args.arch}{where}")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
