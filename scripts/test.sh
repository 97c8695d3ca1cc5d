#!/usr/bin/env bash
# The test command (README "Run the tests", and what CI runs): sets up .venv from the pinned requirements when it
# is missing, then checks the build, the README sections, the refusals section of CONFLICTS_LOG.md, the compile
# gate (its CI shards and the committed full runs) and runs the whole pytest suite (GPU tests skip without CUDA; on
# a GPU machine they run too).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python scripts/build_bundle.py --check
.venv/bin/python scripts/readme_sections.py --check
.venv/bin/python scripts/conflicts_log.py --check
# the compile gate in CI's form (scripts/gate_ci.py, README "Compile gate"): the committed full run of each target in
# gate_ci.FULL_ARCHS (sm_120a: benchmarks/results/gate_full_<arch>.jsonl) must be fresh, fully passing and complete; then a deterministic
# shard of each full worklist, plus what the working tree changed in the kernels since the full run (about 14
# minutes on two cores).  Its status is returned after the test suite, so a stale full run does not hide the tests.
gate=0
.venv/bin/python scripts/compile_gate.py --ci --jobs "${GATE_JOBS:-2}" || gate=$?
# the FP8 forward's gate (QMMA e4m3 in the SASS, 0 spills): a rotating thirty-second of its sm_120a worklist, about 3
# minutes on two cores (scripts/gate_fp8.py; benchmarks/results/fp8_gate_sm120a_ci_shard0_cpu.jsonl)
.venv/bin/python scripts/gate_fp8.py --ci || gate=$?
.venv/bin/python -m pytest -q --timeout 900 tests "$@"
exit "$gate"
