"""Could the FP8 forward serve head dim 256?  Compiles d256 forms of kernels/fwd_fp8.py on the CPU (config_fp8's
head-dim list widened for this process only) for sm_120a and sm_90a and records registers, spills and shared
memory: the dense tile at 64 and 32 keys per K/V tile (plain; causal + window + sink + softcap) and the packed
decode tile (split; paged + causal + window + sink + softcap).

    .venv/bin/python benchmarks/experiments/probe_fp8_d256.py   # -> results/probe_fp8_d256_cpu.jsonl (~3 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPECS = (dict(causal=False), dict(causal=True, local=True, has_sink=True, softcap=True),
         dict(causal=False, varlen=True, pack_gqa=True, split=True, out_dtype="fp32", q_dtype="bf16", tile_m=16,
              num_warps=2, kv_warps=2),
         dict(causal=True, varlen=True, pack_gqa=True, split=True, paged=True, out_dtype="fp32", q_dtype="bf16",
              tile_m=16, num_warps=2, kv_warps=2, softcap=True, local=True, has_sink=True))


def child(arch: str) -> None:
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp())
    sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT)]
    from flash_attn_4_sm120 import config_fp8 as C
    from flash_attn_4_sm120.dispatch_fp8 import compile_fp8
    from scripts.sass_check import inspect_cubin

    C.FP8_HEAD_DIMS = (64, 128, 256)
    for tile_n in (64, 32):
        for spec in SPECS:
            cfg = C.Fp8FwdConfig(**{**dict(head_dim=256, head_dim_v=256, out_dtype="bf16", tile_n=tile_n), **spec})
            row = dict(arch=arch, config=cfg.name())
            try:
                C.can_implement(cfg)
                fn, kernel = compile_fp8(cfg, with_kernel=True)
                cubin = fn.__cubin__
                cubin = Path(cubin).read_bytes() if isinstance(cubin, str) else cubin
                rep = inspect_cubin(cubin)
                row.update(regs=rep.registers, spills=rep.spills, frame=rep.frame_bytes, smem=kernel.launch_smem_bytes)
            except Exception as exc:  # noqa: BLE001 - a form that cannot be built is recorded
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(json.dumps(row), flush=True)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    rows = []
    for arch in ("sm_120a", "sm_90a"):  # one process per arch: CUTE_DSL_ARCH is read once
        res = subprocess.run([sys.executable, __file__, "--child", arch], capture_output=True, text=True)
        rows += [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    out = HERE / "results" / "probe_fp8_d256_cpu.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(r)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
