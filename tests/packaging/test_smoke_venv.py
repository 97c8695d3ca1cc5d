"""The clean-venv smoke (scripts/smoke_venv.py): install requirements.txt, build, serve, load. Minutes; marked slow."""

from __future__ import annotations

import subprocess

import pytest

from hubtools import ROOT, script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def pins() -> dict[str, str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def test_bundle_installs_builds_and_loads_in_a_clean_venv(tmp_path):
    proc = script("smoke_venv.py", "--venv", str(tmp_path / "venv"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "[smoke] passed" in proc.stdout
    assert "kernels.get_kernel('smoke-test/flash-attn-4-sm120', version=1, trust_remote_code=True)" in proc.stdout
    loaded = [line for line in proc.stdout.splitlines() if line.startswith("loaded _flash_attn_4_sm120_cuda_")]
    assert len(loaded) == 1, proc.stdout
    if (ROOT / "scripts" / "compile_gate.py").is_file():
        assert "compile_gate.py --limit 1" in proc.stdout
    else:
        assert "compile_gate.py does not exist yet" in proc.stdout
    code = "import kernels, huggingface_hub; print(kernels.__version__, huggingface_hub.__version__)"
    versions = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", code],
                              capture_output=True, text=True, check=True).stdout.split()
    assert versions == [pins()["kernels"], pins()["huggingface_hub"]]
