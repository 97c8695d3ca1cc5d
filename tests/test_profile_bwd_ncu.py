"""benchmarks/profile_bwd_ncu.py on the CPU: ncu's CSV (a hand-written sample in ncu's ``--csv --metrics`` format,
tests/data/ncu_bwd_sample.csv: ncu's own lines around it, thousands separators, scaled units, n/a), the split into
jobs at the sentinel kernels, the per-kernel and total rows with the red/atom instructions per dQ element, the
metric fallbacks, the ncu command, the job plan, and each forced variant against the host configuration it must
select."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import profile_bwd_ncu as P  # noqa: E402

SAMPLE = (ROOT / "tests" / "data" / "ncu_bwd_sample.csv").read_text()
LISTED = {"gpu__time_duration", "sm__pipe_tensor_op_hmma_cycles_active", "l1tex__data_pipe_lsu_wavefronts_mem_shared",
          "smsp__warps_eligible", "lts__t_bytes", "dram__bytes", "smsp__inst_executed_op_global_red",
          "smsp__inst_executed_op_global_atom"}  # the metrics the sample carries
LLAMA_DQ = 4 * 4096 * 32 * 128  # B * S * Hq * d of llama3-8b at S=4096 (batch 16384 // 4096)


def test_csv_parsed_in_launch_order_with_units():
    kernels = P.parse_ncu_csv(SAMPLE)
    assert [k["id"] for k in kernels] == list(range(6))
    assert [P.short_name(k["name"]) for k in kernels] == [
        "spin_kernel", "bwd_preprocessFlashBwdPreprocess", "bwd_dkdvFlashBwdDkdv", "bwd_dq_convertFlashDqConvert",
        "spin_kernel", "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"]
    pre, fused = kernels[1]["metrics"], kernels[2]["metrics"]
    assert pre["gpu__time_duration.sum"] == pytest.approx(85_310.0)  # 85.31 usecond
    assert pre["lts__t_bytes.sum"] == pytest.approx(270_530_000.0)  # 270.53 Mbyte
    assert fused["lts__t_bytes.sum"] == 4_819_361_792.0  # thousands separators
    assert fused["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"] == 45.87
    assert kernels[2]["grid"] == "(32, 8, 4)" and kernels[2]["block"] == "(256, 1, 1)"
    assert kernels[4]["metrics"]["dram__bytes.sum"] is None  # n/a


def test_split_at_sentinels():
    kernels = P.parse_ncu_csv(SAMPLE)
    jobs = [object(), object()]
    (j0, ours), (j1, sdpa) = P.split_at_sentinels(kernels, jobs)
    assert (j0, j1) == tuple(jobs)
    assert [k["id"] for k in ours] == [1, 2, 3] and [k["id"] for k in sdpa] == [5]
    with pytest.raises(ValueError, match="2 sentinel kernels .* 3 profiled jobs"):
        P.split_at_sentinels(kernels, jobs + [object()])
    with pytest.raises(ValueError, match="before the first sentinel"):
        P.split_at_sentinels(kernels[1:], jobs)


def test_rows_and_reds_per_dq_element():
    kernels = P.parse_ncu_csv(SAMPLE)
    chosen = P.choose_metrics(LISTED)
    assert set(chosen) == {"duration_ns", "tensor_pipe_pct", "shared_pipe_pct", "eligible_warps", "l2_bytes",
                           "dram_bytes", "red_inst", "atom_inst"}  # the rest are not listed: left out
    rows = P.kernel_rows({"variant": "default"}, kernels[1:4], chosen, LLAMA_DQ)
    pre, fused, cvt, total = rows
    assert [r["kind"] for r in rows] == ["kernel"] * 3 + ["total"] and total["kernels"] == 3
    # the fused kernel's red.global.add.v2.f32: 32 key tiles of 128 add into every query tile, 64 elements a warp
    # instruction -> 32 / 64 per dQ element
    assert fused["red_inst"] == 33_554_432 and fused["reds_per_dq_elem"] == pytest.approx(0.5)
    assert pre["reds_per_dq_elem"] == 0.0 and cvt["kernel"] == "bwd_dq_convertFlashDqConvert"
    assert total["duration_ns"] == pytest.approx(85_310 + 3_512_448 + 61_216)
    assert total["l2_bytes"] == pytest.approx(270_530_000 + 4_819_361_792 + 402_817_024)
    assert total["tensor_pipe_pct"] == pytest.approx(45.87 * 3_512_448 / (85_310 + 3_512_448 + 61_216))
    assert total["eligible_warps"] == pytest.approx((0.37 * 85_310 + 0.61 * 3_512_448 + 0.85 * 61_216)
                                                    / (85_310 + 3_512_448 + 61_216))
    assert total["reds_per_dq_elem"] == pytest.approx(0.5)
    (sdpa, sdpa_total) = P.kernel_rows({}, kernels[5:], chosen, LLAMA_DQ)
    assert sdpa["reds_per_dq_elem"] == pytest.approx((16_777_216 + 1_024) / LLAMA_DQ)  # reds and atoms together
    assert sdpa_total["duration_ns"] == 4_101_120
    # a metric ncu reported as n/a leaves its sums and per-element count unknown, not zero
    (spin, spin_total) = P.kernel_rows({}, kernels[4:5], chosen, LLAMA_DQ)
    assert spin["dram_bytes"] is None and spin_total["dram_bytes"] is None


def test_group_rows_pair_jobs_with_kernels_and_keep_errors():
    kernels = P.parse_ncu_csv(SAMPLE)
    meta = dict(device="NVIDIA H100 80GB HBM3", jobs=[
        dict(cell="llama3-8b:4096", variant="default", profiled=True, event_ms=3.9, configs=["bwd_x"]),
        dict(cell="llama3-8b:4096", variant="fused_64x64", error="check failed: dq"),
        dict(cell="llama3-8b:4096:causal", variant="sdpa_flash", profiled=True),
        dict(cell="mha-d64:4096:causal", variant="frost", skipped="time budget (--budget-s)")])
    rows = P.group_rows(meta, kernels, P.choose_metrics(LISTED), dict(run_id="r", group="g"))
    kinds = [(r["variant"], r["kind"]) for r in rows]
    assert kinds == [("default", "kernel")] * 3 + [("default", "total"), ("fused_64x64", "error"),
                                                   ("sdpa_flash", "kernel"), ("sdpa_flash", "total"),
                                                   ("frost", "error")]
    assert rows[3]["event_ms"] == 3.9 and rows[3]["status"] == "kept" and rows[3]["cell"] == "llama3-8b:4096"
    assert rows[4]["error"] == "check failed: dq" and rows[7]["error"].startswith("time budget")
    assert rows[5]["causal"] is True and rows[5]["kernel"] == "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel"
    # one sentinel short: no kernel is attributed to the wrong job, every profiled job is an error row
    meta["jobs"][1] = dict(cell="llama3-8b:4096", variant="fused_64x64", profiled=True)
    rows = P.group_rows(meta, kernels, P.choose_metrics(LISTED), {})
    assert all(r["kind"] == "error" for r in rows) and "3 profiled jobs" in rows[0]["error"]


QUERY = """Device NVIDIA H100 80GB HBM3 (GH100)
--------------------------------------------------------------------- -----------------------------------------
Metric Name                                                            Metric Description
dram__bytes_read                                                       # of bytes read from DRAM
dram__bytes_write                                                      # of bytes written to DRAM
gpu__time_duration                                                     total duration in nanoseconds
lts__t_bytes                                                           # of bytes requested
sm__inst_executed_pipe_tensor_op_hmma                                  # of warp instructions executed by hmma pipe
smsp__inst_executed_op_global_red                                      # of warp instructions executed: RED
"""


def test_metric_fallbacks():
    listed = P.parse_query_metrics(QUERY)
    assert "dram__bytes_read" in listed and "Metric" not in listed
    assert P.parse_query_metrics("==ERROR== no device") is None
    chosen = P.choose_metrics(listed)
    assert chosen["tensor_pipe_pct"][0] == ("sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",)
    assert chosen["dram_bytes"][0] == ("dram__bytes_read.sum", "dram__bytes_write.sum")
    assert "atom_inst" not in chosen and "eligible_warps" not in chosen
    assert P.quantity({"dram__bytes_read.sum": 10.0, "dram__bytes_write.sum": 5.0}, chosen["dram_bytes"]) == 15.0
    assert P.quantity({"dram__sectors_read.sum": 2.0, "dram__sectors_write.sum": 1.0},
                      P.METRICS["dram_bytes"][2]) == 96.0  # 32-byte sectors
    # a listing unknown: the first candidate; one ncu rejects: the next
    first = P.choose_metrics(None)
    text = "==ERROR== Failed to find metric sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    bad = P.rejected_metrics(text, [n for names, _ in first.values() for n in names])
    assert bad == {"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"}
    assert P.choose_metrics(None, bad)["tensor_pipe_pct"] == P.METRICS["tensor_pipe_pct"][1]


def test_ncu_command():
    argv = P.ncu_argv("ncu", ["b.sum", "a.sum", "a.sum"], ["python", "x.py"], "flash", 2, 30)
    assert argv[:3] == ["ncu", "--csv", "--print-units"] and argv[-2:] == ["python", "x.py"]
    opts = dict(zip(argv[1:-2:], argv[2:-2]))
    assert opts["--metrics"] == "a.sum,b.sum" and opts["--profile-from-start"] == "off"
    assert opts["--kernel-name"] == f"regex:flash|{P.SENTINEL}"
    assert opts["--launch-skip"] == "2" and opts["--launch-count"] == "30" and opts["--clock-control"] == "base"


def test_job_plan():
    cells = [P.parse_cell(c) for c in P.DEFAULT_CELLS]
    assert cells[0] == P.Cell("llama3-8b", 32, 8, 128, 4096, 4, False) and cells[0].dq_elems == LLAMA_DQ
    groups = dict(P.plan_groups(list(P.VARIANTS.values()), cells))
    assert list(groups) == ["main", "relay_heads_outer", "relay_after_s", "lpt_off", "peers"]
    assert groups["relay_heads_outer"] == [("llama3-8b:4096", "relay_heads_outer"),
                                           ("llama3-8b:4096:causal", "relay_heads_outer")]
    main = groups["main"]
    assert ("mha-d64:4096:causal", "pair") in main and ("llama3-8b:4096", "pair") not in main
    assert ("llama3-8b:4096", "pair_deterministic_d128") in main
    assert [c for c, v in main if v == "fused_32x32w4"] == ["mha-d256:4096:causal"]
    assert ("mha-d256:4096:causal", "deterministic") not in main  # the pair, as the default there
    assert groups["lpt_off"] == [("llama3-8b:4096:causal", "lpt_off"), ("mha-d64:4096:causal", "lpt_off")]
    assert [v for _, v in groups["peers"]] == ["sdpa_flash"] * 4 + ["frost"] * 4
    assert [c for c, _ in main] == sorted([c for c, _ in main], key=[x.spec for x in cells].index)  # cell by cell
    env = P.group_env("relay_after_s")
    assert env["FA4_SM120_CACHE_DIR"].endswith("-ncu-relay_after_s") and env["FA4_SM120_PREBUILT"] == "0"
    assert P.group_env("main") == {} and P.group_env("peers") == {}
    for bad in ("llama3-8b:4k", "nope:4096", "llama3-8b:4096:full"):
        with pytest.raises(ValueError, match="shape:seqlen"):
            P.parse_cell(bad)
    assert P.device_tag("NVIDIA H100 80GB HBM3") == "h100" and P.device_tag("NVIDIA H200") == "h200"
    assert P.device_tag("NVIDIA GeForce RTX 5090") == "nvidia_geforce_rtx_5090"


# ---- each forced variant selects what it names (host configuration, no kernel built) ---------------------------
def _names(*cfgs) -> str:
    return ",".join(sorted(c.name() for c in cfgs))


@pytest.mark.parametrize("d,windowed", [(64, True), (128, False), (128, True)])
def test_forced_fused_64x64(d, windowed):
    from flash_attn_4_sm120 import config_bwd

    v = P.VARIANTS["fused_64x64"]
    shipped = config_bwd.select_fused_config("bf16", d, d, windowed=windowed)
    assert (shipped.tile_m, shipped.tile_n) != (64, 64) and not re.search(v.expect, _names(shipped))
    with P.forced(v, d):
        cfg = config_bwd.select_fused_config("bf16", d, d, windowed=windowed)
        assert (cfg.tile_m, cfg.tile_n, cfg.num_warps) == (64, 64, 8)
        assert re.search(v.expect, _names(cfg, config_bwd.dq_convert_config(cfg)))
    assert config_bwd.select_fused_config("bf16", d, d, windowed=windowed) == shipped  # restored


def test_forced_d256_fused_tile():
    from flash_attn_4_sm120 import config_bwd

    v = P.VARIANTS["fused_32x32w4"]
    pair = config_bwd.select_bwd_config("bf16", 256, 256, windowed=True)
    default, _ = config_bwd.fused_for(pair)  # the V-in-registers tile since it became d256's default
    assert isinstance(default, config_bwd.BwdVRegsKernelConfig) and (default.tile_m, default.tile_n) == (32, 64)
    with P.forced(v, 256):
        fused, cvt = config_bwd.fused_for(pair)
        assert (fused.tile_m, fused.tile_n, fused.num_warps) == (32, 32, 4) and re.search(v.expect, _names(fused, cvt))
    assert config_bwd.fused_for(pair)[0] == default


def test_forced_pair_at_d128():
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd

    v = P.VARIANTS["pair_deterministic_d128"]
    pair = config_bwd.select_bwd_config("bf16", 128, 128)
    relay, _ = config_bwd.fused_for(pair, relay=True)  # deterministic=True's default at d128: the relay
    assert relay.dq_relay and not re.search(v.expect, relay.name())
    with P.forced(v, 128):
        assert dispatch_bwd.fused_plan(None, None, True) is None  # the pair
    names = _names(pair, config_bwd.select_dq_config("bf16", 128, 128))
    assert re.search(v.expect, names)
    assert re.search(P.VARIANTS["relay_heads_outer"].expect, relay.name())


def test_forced_pair_and_constants():
    from flash_attn_4_sm120 import config_bwd, dispatch_bwd

    real = dispatch_bwd.fused_plan
    v = P.VARIANTS["pair"]
    with P.forced(v, 64):
        assert dispatch_bwd.fused_plan(None, None) is None and dispatch_bwd.fused_plan(None, None, True) is None
    assert dispatch_bwd.fused_plan is real
    pair = config_bwd.select_bwd_config("bf16", 64, 64, windowed=True)
    names = _names(pair, config_bwd.select_dq_config("bf16", 64, 64, windowed=True))
    assert re.search(v.expect, names) and not re.search(v.expect, _names(*config_bwd.fused_for(pair)))
    for name, attr, value in (("relay_after_s", "DQ_RELAY_RELEASE", "after_s"), ("lpt_off", "BWD_LPT_ORDER", False),
                              ("relay_heads_outer", "RELAY_HEADS_INNER", False)):
        before = getattr(config_bwd, attr)
        with P.forced(P.VARIANTS[name], 64):
            assert getattr(config_bwd, attr) == value != before
        assert getattr(config_bwd, attr) == before
    relay, _ = config_bwd.fused_for(pair, relay=True)  # what relay_after_s's check reads at d64
    assert re.search(P.VARIANTS["relay_after_s"].expect, relay.name())


# ---- the driver end to end, with a stand-in for ncu (no GPU: the compile step is skipped) ----------------------
FAKE_NCU = '''import json, sys
a = sys.argv[1:]
if a == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2025.1.0.0 (build 1)")
elif a == ["--query-metrics"]:
    print(open(sys.argv[0] + ".query").read())
else:
    open(sys.argv[0] + ".calls", "a").write(json.dumps(a) + "\\n")
    metrics = a[a.index("--metrics") + 1].split(",")
    if "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active" in metrics:
        print("==ERROR== Failed to find metric sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")
        sys.exit(1)
    jobs = json.loads(a[a.index("--child") + 1])
    meta = dict(device="Fake GPU", jobs=[dict(cell=c, variant=v, profiled=True, event_ms=1.5) for c, v in jobs])
    open(a[a.index("--meta") + 1], "w").write(json.dumps(meta))
    print(open(sys.argv[0] + ".csv").read())
'''


def test_driver_end_to_end_with_a_rejected_metric(tmp_path, monkeypatch):
    import json

    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\n" + FAKE_NCU)
    ncu.chmod(0o755)
    (tmp_path / "ncu.csv").write_text(SAMPLE)
    (tmp_path / "ncu.query").write_text(QUERY + "".join(f"{m}  description\n" for m in LISTED))
    monkeypatch.setattr(P, "compile_first", lambda groups, workdir, jobs_n, deadline: [])
    out = tmp_path / "rows.jsonl"
    assert P.main(["--ncu", str(ncu), "--cells", "llama3-8b:4096", "llama3-8b:4096:causal", "--variants", "default",
                   "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    calls = [json.loads(x) for x in (tmp_path / "ncu.calls").read_text().splitlines()]
    assert len(calls) == 2  # rejected once, then run with the next tensor-pipe candidate
    second = calls[1][calls[1].index("--metrics") + 1].split(",")
    assert "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active" in second
    assert not any(m.startswith("sm__pipe_tensor_op_hmma") for m in second)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows[0]["kind"] == "run" and rows[0]["metrics"]["red_inst"] == ["smsp__inst_executed_op_global_red.sum"]
    kinds = [(r["cell"], r["kind"]) for r in rows[1:]]
    assert kinds == [("llama3-8b:4096", "kernel")] * 3 + [("llama3-8b:4096", "total"),
                                                          ("llama3-8b:4096:causal", "kernel"),
                                                          ("llama3-8b:4096:causal", "total")]
    total = rows[4]
    assert total["reds_per_dq_elem"] == pytest.approx(0.5) and total["event_ms"] == 1.5
    assert total["device"] == "Fake GPU" and total["tensor_pipe_pct"] is None  # the sample holds the other metric
    fallback = "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"
    assert total["metrics"]["tensor_pipe_pct"] == [fallback]  # the header keeps the first choice
    assert rows[0]["metrics"]["tensor_pipe_pct"] == [P.METRICS["tensor_pipe_pct"][0][0][0]]


def test_sdpa_job_passes_the_reference_check_and_a_wrong_gradient_fails():
    # the SDPA FLASH job as the child builds it (K/V expanded to the query heads), on the CPU's flash backend,
    # through bench_bwd's check of batch 0 / KV head 0
    import torch
    import bench_bwd

    cell = P.Cell("tiny", 4, 2, 32, 64, 2, True)
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(cell.batch, cell.seqlen, h, cell.d, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, gout = mk(4).requires_grad_(), mk(2).requires_grad_(), mk(2).requires_grad_(), mk(4)
    refs = bench_bwd.reference_grads(q, k, v, gout, cell.causal)
    dq, dk, dv = P._call(P.VARIANTS["sdpa_flash"], cell, None, q, k, v, gout)()
    assert dk.shape == (2, 64, 4, 32)  # per query head: the check sums each group
    row = dict(hkv=cell.hkv)
    assert bench_bwd.check_grads(row, "v", (dq, dk, dv), refs, 2) and set(row["v_max_err"]) == {"dq", "dk", "dv"}
    row = dict(hkv=cell.hkv)
    assert not bench_bwd.check_grads(row, "v", (dq, dk, dv * 1.5), refs, 2) and "dv" in row["v_error"]
