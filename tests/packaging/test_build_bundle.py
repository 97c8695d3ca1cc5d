"""scripts/build_bundle.py: the variant it writes, its metadata, determinism, --check, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest
from kernels._rust import Backend, Digest, DigestAlgorithm, Metadata

from hubtools import ROOT, git, make_project, script

PKG = "torch-ext/flash_attn_4_sm120"


@pytest.fixture
def project(tmp_path):
    return make_project(tmp_path / "proj")


def build(project, *args):
    return script("build_bundle.py", "--root", str(project), *args)


def variant(project):
    return project / "build" / "torch-cuda"


def test_metadata_is_what_kernels_reads(project):
    proc = build(project)
    assert proc.returncode == 0, proc.stderr
    meta = Metadata.read_from_file(variant(project) / "metadata.json")
    toml = tomllib.loads((project / "build.toml").read_text())["general"]
    assert str(meta.name) == toml["name"] and meta.version == toml["version"] and meta.license == toml["license"]
    assert meta.python_depends == toml["python-depends"] + toml["cuda"]["python-depends"]
    assert meta.backend.backend_type == Backend.CUDA
    assert meta.backend.archs == tomllib.loads((project / "build.toml").read_text())["torch-noarch"][
        "cuda_capabilities"]
    assert str(meta.kernels_minver) == "0.17.2"
    assert re.fullmatch(r"_flash_attn_4_sm120_cuda_[0-9a-f]{7}", meta.id)
    assert meta.id in proc.stdout


def test_digest_equals_kernels_hash_variant(project):
    (project / PKG / "sub").mkdir()
    (project / PKG / "sub" / "helper.py").write_text("X = 1\n")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "nested module")
    assert build(project).returncode == 0
    meta = Metadata.read_from_file(variant(project) / "metadata.json")
    actual = Digest.hash_variant(DigestAlgorithm.SHA256, variant(project))
    assert meta.digest.files == actual.files
    assert "sub/helper.py" in actual.files
    meta.digest.validate(actual)


def test_provenance_is_last_source_commit_and_survives_committing_build(project):
    source_commit = git(project, "rev-parse", "HEAD").strip()
    assert build(project).returncode == 0
    kernel = json.loads((variant(project) / "metadata.json").read_text())["provenance"]["kernel"]
    assert kernel == {"commit": source_commit, "dirty": False}
    git(project, "add", "build")
    git(project, "commit", "-q", "-m", "build")
    assert git(project, "rev-parse", "HEAD").strip() != source_commit
    check = build(project, "--check")
    assert check.returncode == 0, check.stderr
    assert "up to date" in check.stdout


def test_same_sources_give_byte_identical_output(project, tmp_path):
    assert build(project).returncode == 0
    assert build(project, "--out", str(tmp_path / "other")).returncode == 0
    first = {p.relative_to(variant(project)): p.read_bytes() for p in variant(project).rglob("*") if p.is_file()}
    second = {p.relative_to(tmp_path / "other" / "torch-cuda"): p.read_bytes()
              for p in (tmp_path / "other" / "torch-cuda").rglob("*") if p.is_file()}
    assert first == second


def test_id_follows_file_contents(project):
    assert build(project).returncode == 0
    before = json.loads((variant(project) / "metadata.json").read_text())["id"]
    with open(project / PKG / "features.py", "a") as f:
        f.write("\n# changed\n")
    assert build(project).returncode == 0
    after = json.loads((variant(project) / "metadata.json").read_text())
    assert after["id"] != before
    assert after["provenance"]["kernel"]["dirty"] is True


def test_no_bytecode_ignored_files_or_stale_files(project):
    assert build(project).returncode == 0
    (project / PKG / "__pycache__").mkdir()
    (project / PKG / "__pycache__" / "features.cpython-311.pyc").write_bytes(b"\0")
    (project / PKG / "kernel.cubin").write_bytes(b"\0")  # ignored by .gitignore
    (variant(project) / "stale.py").write_text("")
    (project / "build" / "torch-cpu").mkdir()
    proc = build(project)
    assert proc.returncode == 0
    files = sorted(p.relative_to(variant(project)).as_posix() for p in variant(project).rglob("*") if p.is_file())
    sources = sorted(p.relative_to(project / PKG).as_posix() for p in (project / PKG).rglob("*")
                     if p.suffix == ".py" or p.name == "prebuilt_set.json")  # the set publish builds (prebuilt)
    assert files == sorted(sources + ["metadata.json"])
    assert sorted(p.name for p in (project / "build").iterdir()) == ["torch-cuda"]
    assert "removed stale build/torch-cpu" in proc.stdout


def test_untracked_source_file_is_built_and_marks_dirty(project):
    (project / PKG / "new_module.py").write_text("Y = 2\n")
    assert build(project).returncode == 0
    meta = json.loads((variant(project) / "metadata.json").read_text())
    assert "new_module.py" in meta["digest"]["files"]
    assert meta["provenance"]["kernel"]["dirty"] is True


def test_check_fails_after_source_commit_with_rebuild_hint(project):
    assert build(project).returncode == 0
    git(project, "add", "build")
    git(project, "commit", "-q", "-m", "build")
    with open(project / PKG / "features.py", "a") as f:
        f.write("\n# new\n")
    git(project, "commit", "-q", "-am", "change features")
    check = build(project, "--check")
    assert check.returncode == 1
    assert "build/torch-cuda/features.py differs" in check.stderr
    assert "build/torch-cuda/metadata.json differs" in check.stderr
    assert "run python scripts/build_bundle.py and commit build/" in check.stderr


def test_check_with_uncommitted_sources_says_commit_first(project):
    assert build(project).returncode == 0
    (project / PKG / "features.py").write_text("FEATURES = {}\n")
    check = build(project, "--check")
    assert check.returncode == 1
    assert "uncommitted changes: commit them first" in check.stderr


def test_check_fails_when_variant_dir_missing(project):
    check = build(project, "--check")
    assert check.returncode == 1
    assert "build/torch-cuda/ does not exist" in check.stderr


def test_outside_git_builds_without_provenance(tmp_path):
    project = make_project(tmp_path / "proj", commit=False)
    subprocess.run(["rm", "-rf", str(project / ".git")], check=True)
    proc = build(project)
    assert proc.returncode == 0, proc.stderr
    assert "no git provenance" in proc.stdout
    assert "provenance" not in json.loads((variant(project) / "metadata.json").read_text())


def test_shallow_clone_boundary_is_refused(project, tmp_path):
    (project / "CARD.md").write_text("later commit that does not touch the sources\n")
    git(project, "commit", "-q", "-am", "card")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{project}", str(clone)], check=True)
    proc = build(clone)
    assert proc.returncode == 2
    assert "shallow clone" in proc.stderr and "git fetch --unshallow" in proc.stderr


BAD_TOML = [
    ("[general\nname = 'x'\n", "is not valid TOML"),
    (None, "Unknown field cuda-capabilities"),  # the documented spelling, which the parser rejects
    ('[general]\nname = "flash-attn-4-sm120"\nversion = 1\nedition = 5\nlicense = "BSD-3-Clause"\n'
     'backends = ["cuda"]\npython-depends = ["numpy"]\n[torch-noarch]\ncuda_capabilities = ["12.0"]\n',
     "python-depends has 'numpy'"),
    ('[general]\nname = "flash-attn-4-sm120"\nversion = 1\nedition = 5\nlicense = "BSD-3-Clause"\n'
     'backends = ["cuda"]\n[torch-noarch]\ncuda_capabilities = ["sm120"]\n', "cuda_capabilities has ['sm120']"),
    ('[general]\nname = "flash-attn-4-sm120"\nversion = 1\nlicense = "BSD-3-Clause"\nbackends = ["cuda"]\n',
     "legacy format"),
]


@pytest.mark.parametrize("text,message", BAD_TOML, ids=["syntax", "dash-key", "dep", "capability", "no-edition"])
def test_malformed_build_toml_is_explained(project, text, message):
    if text is None:
        text = (project / "build.toml").read_text().replace("cuda_capabilities", "cuda-capabilities")
    (project / "build.toml").write_text(text)
    proc = build(project)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "build.toml" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_package_dir_is_explained(project):
    subprocess.run(["git", "-C", str(project), "mv", PKG, "torch-ext/renamed"], check=True)
    proc = build(project)
    assert proc.returncode == 2
    assert "torch-ext/flash_attn_4_sm120/__init__.py not found" in proc.stderr


def test_version_mismatch_between_package_and_build_toml(project):
    init = project / PKG / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "1.', '__version__ = "2.'))
    proc = build(project)
    assert proc.returncode == 2
    assert "__version__ = '2." in proc.stderr and "version = 1" in proc.stderr


def test_committed_build_is_current():
    """CI guard: the committed build/ matches the committed sources (skipped while sources are being edited)."""
    dirty = git(ROOT, "status", "--porcelain", "--", PKG, "build.toml")
    if dirty.strip():
        pytest.skip(f"uncommitted source changes; --check would ask to commit them first:\n{dirty}")
    check = script("build_bundle.py", "--check")
    assert check.returncode == 0, check.stderr
