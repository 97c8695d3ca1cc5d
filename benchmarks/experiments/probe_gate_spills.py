"""Compile named candidate configurations for one target with the compile gate's check (scripts/compile_gate.py
``_check_one``: HMMA present, no forbidden instruction, no spill, the shared memory the config says) and append
one row per configuration to a JSON-lines file.  For configurations the gate's worklist does not hold (yet): the
tile a feature set should move to before the config layer selects it.

    python benchmarks/experiments/probe_gate_spills.py --arch sm_80 --set sm80_s33 --only dq_ --json out.jsonl

The candidate sets are written out below, one function per question; ``--only`` keeps the names containing it.
CPU only (fake tensors, no GPU); one configuration takes a core for 1-3 minutes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def sm80_s33() -> list:
    """Issue 31: the tiles the sm_80 full run of 7c4925a's seven spilling configurations could move to
    (benchmarks/results/gate_spill_probes_sm80_s33.jsonl)."""
    from scripts.compile_gate import _package

    _package()
    from flash_attn_4_sm120 import config_bwd as CB, modspec
    from flash_attn_4_sm120.config import FwdKernelConfig, FwdTile

    doc = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
    rel_fwd = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), False)
    rel = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), True)
    heavy = dict(windowed=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True, has_dropout=True,
                 dropout_seed_tensor=True, sink_grad=True)
    fwd_heavy = dict(windowed=True, has_sink=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True,
                     has_dropout=True, dropout_seed_tensor=True, mods=rel_fwd)
    # the seven as the full run built them (this machine's libs may differ from the run's)
    out = [CB.BwdKernelConfig("bf16", 128, 128, 32, 128, 8, kv_rows=True, varlen_q=True, varlen_k=True, mods=doc),
           CB.BwdKernelConfig("fp16", 96, 96, 64, 128, 8, kv_rows=True, sparse_q_ratio=1, sparse_kv_ratio=1),
           CB.DqKernelConfig("bf16", 192, 96, 64, 64, 4, has_softcap=True, **heavy),
           CB.DqKernelConfig("bf16", 192, 192, 64, 64, 4, mods=rel, **{**heavy, "has_softcap": False}),
           replace(FwdKernelConfig("bf16", 192, 192, FwdTile(64, 16, 4, 1), **fwd_heavy), dropout_packed=True)]
    # dK/dV d128 with the document mask mod, varlen: the 32x128 P/dS tile (same shape as the key-row one)
    for flags in (dict(varlen_q=True, varlen_k=True), dict(varlen_q=True, varlen_k=True, seqused_k=True),
                  dict(), dict(windowed=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)):
        out.append(CB.BwdKernelConfig("bf16", 128, 128, 32, 128, 8, mods=doc, **flags))
    # dK/dV d96 fp16 block-sparse: the key-row tile spilled at 1x1 blocks; the 64x64 tile
    for r, flags in ((1, {}), (2, dict(windowed=True, has_softcap=True, varlen_q=True, varlen_k=True,
                                       seqused_q=True, seqused_k=True))):
        out.append(CB.BwdKernelConfig("fp16", 96, 96, 64, 64, 8, sparse_q_ratio=r, sparse_kv_ratio=r, **flags))
    # dQ d192 with dropout: 64x32 instead of 64x64 (with and without the split K/V wait)
    for dtype, dv, kw in (("bf16", 96, True), ("fp16", 96, True), ("bf16", 192, True), ("bf16", 96, False)):
        out.append(CB.DqKernelConfig(dtype, 192, dv, 64, 32, 4, kv_stages=1, split_kv_wait=kw, has_softcap=True,
                                     **heavy))
    out.append(CB.DqKernelConfig("bf16", 192, 192, 64, 32, 4, kv_stages=1, mods=rel, **heavy))
    # forward d192, relative bias + dropout with packed rows: 64x16 with two stages
    base = FwdKernelConfig("bf16", 192, 192, FwdTile(64, 16, 4, 2), **fwd_heavy)
    out += [replace(base, dropout_packed=True), base]
    return out


def sm80_s33_subsets() -> list:
    """Issue 31: the reroutes of ``sm80_s33`` over every subset of the flags their kernels take (the gate builds each
    class at its lightest and heaviest set only): dQ 64x32 at d192/dv96 with dropout (seed tensor, sink gradient;
    window, softcap, varlen q/k, seqused q/k), and the forward's 64x16 two-stage tile at d192 with the relative-bias
    mod and dropout with packed rows (window, sink, varlen q/k, seqused q/k)."""
    import itertools

    from scripts.compile_gate import _package

    _package()
    from flash_attn_4_sm120 import config_bwd as CB, modspec
    from flash_attn_4_sm120.config import FwdKernelConfig, FwdTile

    rel_fwd = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), False)
    out = []
    for bits in itertools.product((False, True), repeat=6):
        flags = dict(zip(("windowed", "has_softcap", "varlen_q", "varlen_k", "seqused_q", "seqused_k"), bits))
        out.append(CB.select_dq_config("bf16", 192, 96, False, has_dropout=True, dropout_seed_tensor=True,
                                       sink_grad=True, **flags))
    for bits in itertools.product((False, True), repeat=6):
        flags = dict(zip(("windowed", "has_sink", "varlen_q", "varlen_k", "seqused_q", "seqused_k"), bits))
        out.append(FwdKernelConfig("bf16", 192, 192, FwdTile(64, 16, 4, 2), mods=rel_fwd, has_dropout=True,
                                   dropout_seed_tensor=True, dropout_packed=True, **flags))
    return out


def qgrid_s37() -> list:
    """Issue 30: the d64 fused tile 64x128 r32 with its S/dP warps 2 x 4 (``q_warp_rows`` 32), on sm_120a: the six
    sets of the brief, each beside the same tile at 16 rows; the fused worklist's sets (bf16 / fp16, d64 at dv64 and
    dv32, windowed or not, every flag, dropout, the causal / document / relative-bias mods) and each one's relay
    form on the q32 tile; and the default d64 tile (16 rows) with aux-reading mods, which no gate run had built on
    a dense walk (benchmarks/results/gate_qgrid_s37.jsonl)."""
    from scripts.compile_gate import _package

    _package()
    from flash_attn_4_sm120 import config_bwd as CB, modspec

    rel = modspec.recipe_placeholder("relative_bias", (64,), (("fp32", 2),), True)
    doc = modspec.recipe_placeholder("document", (True,), (("i32", 1),), False)
    causal = modspec.recipe_placeholder("causal", (), (), False)
    alibi = modspec.recipe_placeholder("alibi", (), (("fp32", 1),), True)
    q32, q16 = (64, 128, 8, 32, "q32"), (64, 128, 8, 32)
    every = dict(windowed=True, has_softcap=True, varlen_q=True, varlen_k=True, seqused_q=True, seqused_k=True)
    out = []
    for flags in ({}, dict(windowed=True), dict(has_dropout=True), dict(has_softcap=True, varlen_q=True,
                                                                         varlen_k=True),
                  dict(mods=rel), dict(dq_relay=True)):
        out += [CB._fused_tile_config("bf16", 64, 64, t, flags) for t in (q32, q16)]
    sets = []
    for dv in (64, 32):
        for w in (False, True):
            heavy = dict(every, windowed=w)
            sets += [("bf16", dv, dict(windowed=w)), ("bf16", dv, heavy), ("bf16", dv, dict(windowed=w, has_dropout=True)),
                     ("bf16", dv, dict(heavy, has_dropout=True, dropout_seed_tensor=True)),
                     ("fp16", dv, dict(windowed=w)), ("fp16", dv, heavy), ("fp16", dv, dict(heavy, has_dropout=True))]
    no_softcap = {k: v for k, v in every.items() if k != "has_softcap"}
    for m in (causal, doc, rel):
        sets += [("bf16", 64, dict(no_softcap, mods=m)), ("bf16", 64, dict(no_softcap, windowed=False, mods=m)),
                 ("bf16", 64, dict(mods=m, has_dropout=True))]
    for relay in (False, True):
        out += [CB._fused_tile_config(dt, 64, dv, q32, dict(fl, dq_relay=relay)) for dt, dv, fl in sets]
    for m in (rel, doc, alibi):
        out += [CB._fused_tile_config("bf16", 64, 64, q16, dict(mods=m, dq_relay=relay)) for relay in (False, True)]
    out += [CB._fused_tile_config("bf16", 64, 64, q16, dict(no_softcap, windowed=False, mods=rel)),
            CB._fused_tile_config("bf16", 64, 64, q16, dict(mods=rel, has_dropout=True))]
    seen = set()
    return [c for c in out if not (c.name() in seen or seen.add(c.name()))]


SETS = {"sm80_s33": sm80_s33, "sm80_s33_subsets": sm80_s33_subsets, "qgrid_s37": qgrid_s37}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_80")
    ap.add_argument("--set", choices=sorted(SETS), required=True)
    ap.add_argument("--only", default=None, help="substring of the configuration names to build")
    ap.add_argument("--list", action="store_true", help="print the names and build nothing")
    ap.add_argument("--json", type=Path, default=None, help="append the rows here")
    args = ap.parse_args(argv)
    work = [c for c in SETS[args.set]() if args.only is None or args.only in c.name()]
    if args.list:
        print("\n".join(c.name() for c in work))
        return 0
    from scripts import gate_ci as GC
    from scripts.compile_gate import _check_one

    version, libs = GC.cutlass_dsl()
    bad = 0
    for cfg in work:
        row = _check_one(cfg, args.arch)
        row.update(cutlass_dsl=version, libs=libs, when=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()))
        bad += bool(row["problems"])
        print(f"{'ok  ' if not row['problems'] else 'FAIL'} {row['config']} regs={row.get('regs')} "
              f"spills={row.get('spills')} {row['problems']}", flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
