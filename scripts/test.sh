#!/usr/bin/env bash
# The test command (README "Run the tests", and what CI runs): sets up .venv from the pinned requirements when it
# is missing, then checks the build, the README sections, the compile gate (a shard, what changed since the
# committed full runs, and that those are fresh: scripts/gate_ci.py) and runs the whole pytest suite (GPU tests skip
# without CUDA; on a GPU machine they run too).
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
.venv/bin/python scripts/compile_gate.py --ci --jobs "${GATE_JOBS:-2}"
.venv/bin/python -m pytest -q --timeout 900 tests "$@"
