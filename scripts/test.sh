#!/usr/bin/env bash
# The test command (README "Run the tests", and what CI runs): sets up .venv from the pinned requirements when it
# is missing, then checks the build, the README sections, the refusals section of CONFLICTS_LOG.md, the compile
# gate (the hand-made worklists for sm_120a) and runs the whole pytest suite (GPU tests skip without CUDA; on a GPU machine they run too).
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
# the hand-made worklists for sm_120a (about 30 minutes on two cores); sm_80 (what 8.0 / 8.6 / 8.9 devices load)
# and the class sweep (scripts/gate_classes.py) do not fit CI's time on top and are run by hand: README "Compile
# gate"
.venv/bin/python scripts/compile_gate.py --no-classes --jobs "${GATE_JOBS:-2}"
.venv/bin/python -m pytest -q --timeout 900 tests "$@"
