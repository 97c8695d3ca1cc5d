"""Build the Hub bundle: copy torch-ext/<python_name>/ into build/torch-cuda/ and write its metadata.json.

    python scripts/build_bundle.py            # (re)write build/torch-cuda
    python scripts/build_bundle.py --check    # exit 1 when build/ differs from a fresh build
    python scripts/build_bundle.py --prebuilt [--arch sm_120a] [--sample N] [--jobs J] [--out DIR] [--report FILE]
                                              # + the compiled prebuilt set (default out: build-prebuilt/);
                                              # --report appends its size per arch to a jsonl file

What a build holds (the layout the `kernels` library loads, see shared/reference/KERNELS_HUB.md):

* every file of the package that git would commit (tracked plus untracked-but-not-ignored files; outside git:
  every file), without ``__pycache__``/``*.pyc``;
* ``metadata.json`` with name, version, license, python-depends and ``backend {cuda, archs}`` from build.toml,
  ``id = _<python_name>_cuda_<7 hex of the content hash of the copied files>`` (the ``sys.modules`` key),
  ``kernels-minver``, a sha256 ``digest`` equal to ``kernels._rust.Digest.hash_variant`` of the variant, and
  ``provenance.kernel = {commit, dirty}``.

Provenance is deterministic so that the build can be committed and checked in CI: ``commit`` is the last commit
that touched the package directory or build.toml (not HEAD, which moves when build/ itself is committed), and
``dirty`` says whether those paths have uncommitted changes. Same sources and same commit give byte-identical
output. The workflow is therefore: commit the sources, run this script, commit build/.

Only the standard library and `kernels` are used, except by ``--prebuilt``: it compiles the declared set of
configurations (``prebuilt_set.json`` in the package, written by scripts/prebuilt_set.py) with CuTe-DSL into
``prebuilt/<arch>/`` of the variant, with its manifest (scripts/prebuilt_build.py), and records those files in the
digest too.  The committed build/ carries the set (what the publish step builds), never the objects: a
prebuilt build goes to another directory (``build-prebuilt/``, ignored by git), which ``publish.py --prebuilt``
uploads.
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANT = "torch-cuda"
# The version this bundle is built and tested against (requirements.txt pins it). kernels >= 0.17.2 enforces this
# key on load; older releases ignore it, so it documents the tested floor without breaking anyone silently.
KERNELS_MINVER = "0.17.2"
# Recorded as provenance.kernel-builder.version (metadata.json requires that entry); bump when the output changes.
BUILDER_VERSION = "flash-attn-4-sm120-build-bundle-1"
REBUILD_HINT = "run python scripts/build_bundle.py and commit build/"
_CAPABILITY = re.compile(r"^\d+\.\d+a?(\+PTX)?$")


class BuildError(Exception):
    """A problem with the sources or build.toml; the message says what to fix."""


@dataclass(frozen=True)
class BuildConfig:
    name: str
    python_name: str
    version: int
    license: str
    python_depends: tuple[str, ...]
    archs: tuple[str, ...]
    upstream: str | None
    source: str | None
    repo_id: str | None

    @property
    def package_rel(self) -> str:
        return f"torch-ext/{self.python_name}"


def _known_python_depends() -> tuple[set[str], set[str]]:
    """The dependency names kernels accepts: (general, cuda-only), from the table kernels ships."""
    data = json.loads((resources.files("kernels") / "python_depends.json").read_text())
    return set(data.get("general", {})), set(data.get("backends", {}).get("cuda", {}))


def read_build_config(root: Path) -> BuildConfig:
    """Parse build.toml with tomllib, validate it with kernels' own parser, and return what the build needs."""
    path = root / "build.toml"
    if not path.is_file():
        raise BuildError(f"{path} not found: the build reads the kernel's name, version and license from it.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"{path} is not valid TOML ({e}). Fix the syntax and run the build again.") from None

    from kernels._rust import Build

    try:
        Build.open(root)
    except ValueError as e:
        raise BuildError(
            f"{path} is rejected by kernels' build.toml parser:\n  {str(e).strip()}\n"
            "Fix build.toml (edition 5; see shared/reference/KERNELS_HUB.md for the accepted keys)."
        ) from None

    general = data.get("general", {})
    cuda = general.get("cuda", {})
    if "cuda" not in general.get("backends", []):
        raise BuildError(f"{path}: [general] backends = {general.get('backends')} lacks \"cuda\"; this build "
                         "only produces build/torch-cuda. Add \"cuda\" to backends.")
    if general.get("kernel-depends") or cuda.get("kernel-depends"):
        raise BuildError(f"{path}: kernel-depends is set, but build_bundle.py does not write kernel dependencies "
                         "into metadata.json yet. Remove it or extend scripts/build_bundle.py.")

    known_general, known_cuda = _known_python_depends()
    depends: list[str] = []
    for section, names, allowed in (("[general]", general.get("python-depends", []), known_general),
                                    ("[general.cuda]", cuda.get("python-depends", []), known_general | known_cuda)):
        for dep in names:
            if dep not in allowed:
                raise BuildError(f"{path}: {section} python-depends has {dep!r}, which kernels "
                                 f"{_kernels_version()} refuses to load (it knows {sorted(allowed)}). "
                                 "Remove it or vendor the code.")
            if dep not in depends:
                depends.append(dep)

    archs = data.get("torch-noarch", {}).get("cuda_capabilities")
    if not archs:
        raise BuildError(f"{path}: [torch-noarch] cuda_capabilities is missing or empty; list the compute "
                         "capabilities the bundle supports, e.g. [\"8.0\", \"9.0\", \"12.0\"].")
    bad = [a for a in archs if not isinstance(a, str) or not _CAPABILITY.match(a)]
    if bad:
        raise BuildError(f"{path}: [torch-noarch] cuda_capabilities has {bad}; each entry must look like "
                         "\"12.0\", \"12.0a\" or \"9.0+PTX\".")

    name = general["name"]
    return BuildConfig(
        name=name,
        python_name=name.replace("-", "_"),
        version=int(general["version"]),
        license=general["license"],
        python_depends=tuple(depends),
        archs=tuple(archs),
        upstream=general.get("upstream"),
        source=general.get("source"),
        repo_id=general.get("hub", {}).get("repo-id"),
    )


def _kernels_version() -> str:
    from importlib.metadata import version

    return version("kernels")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def _is_git_toplevel(root: Path) -> bool:
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return Path(top).resolve() == root.resolve()


def _is_bytecode(rel: str) -> bool:
    parts = rel.split("/")
    return "__pycache__" in parts[:-1] or rel.endswith(".pyc")


def source_files(root: Path, package_rel: str) -> list[str]:
    """Files of the package, relative to the package dir, sorted; what git would commit when in a git tree."""
    pkg = root / package_rel
    if not (pkg / "__init__.py").is_file():
        raise BuildError(f"{pkg}/__init__.py not found: build.toml names the kernel so its package must live in "
                         f"{package_rel}/. Rename the directory or fix [general] name.")
    if _is_git_toplevel(root):
        listed = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", package_rel)
        rels = [p[len(package_rel) + 1:] for p in listed.split("\0") if p]
        rels = [r for r in rels if (pkg / r).is_file()]  # drops tracked files deleted in the work tree
    else:
        rels = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()]
    return sorted(r for r in rels if not _is_bytecode(r))


def file_digest(path: Path) -> str:
    """base64 of the file's sha256, the form kernels' Digest uses."""
    return base64.b64encode(hashlib.sha256(path.read_bytes()).digest()).decode("ascii")


def content_id(digests: dict[str, str]) -> str:
    """First 7 hex of a sha256 over the sorted (path, file digest) pairs."""
    h = hashlib.sha256()
    for rel in sorted(digests):
        h.update(f"{rel}\0{digests[rel]}\n".encode())
    return h.hexdigest()[:7]


def git_provenance(root: Path, paths: list[str]) -> dict | None:
    """{commit, dirty} for `paths`: the last commit touching them, and whether they have uncommitted changes."""
    if not _is_git_toplevel(root):
        return None
    try:
        commit = _git(root, "log", "-1", "--format=%H", "--", *paths).strip() or \
            _git(root, "rev-parse", "--verify", "-q", "HEAD").strip()
    except subprocess.CalledProcessError:
        return None  # no commit at all yet
    if _git(root, "rev-parse", "--is-shallow-repository").strip() == "true":
        shallow = Path(_git(root, "rev-parse", "--path-format=absolute", "--git-path", "shallow").strip())
        if shallow.is_file() and commit in shallow.read_text().split():
            raise BuildError(f"{root} is a shallow clone and {commit[:12]} is its history boundary, so the last "
                             f"commit touching {', '.join(paths)} cannot be known. Run `git fetch --unshallow` "
                             "(in CI: a checkout with full history) and build again.")
    status = _git(root, "status", "--porcelain=v1", "--untracked-files=all", "--", *paths)
    return {"commit": commit, "dirty": bool(status.strip())}


def _package_version(init_py: Path) -> str | None:
    for node in ast.parse(init_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    return None


def render_variant(root: Path, dest: Path, prebuilt: dict | None = None) -> dict:
    """Write the variant into the empty directory `dest`; return its metadata.  ``prebuilt``: the keyword
    arguments of ``prebuilt_build.build_into`` (archs, sample_size, jobs) to add the compiled set."""
    config = read_build_config(root)
    pkg = root / config.package_rel
    rels = source_files(root, config.package_rel)
    pkg_version = _package_version(pkg / "__init__.py")
    if pkg_version is not None and pkg_version.split(".")[0] != str(config.version):
        raise BuildError(f"{config.package_rel}/__init__.py has __version__ = {pkg_version!r} but build.toml has "
                         f"version = {config.version}; the major version is the Hub branch v<version>. "
                         "Make them agree.")
    if "metadata.json" in rels:
        raise BuildError(f"{config.package_rel}/metadata.json would be overwritten by the build's metadata; "
                         "rename it.")
    digests: dict[str, str] = {}
    for rel in rels:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pkg / rel, target)
        digests[rel] = file_digest(target)
    if prebuilt is not None:
        import prebuilt_build

        try:
            prebuilt_build.build_into(dest, **prebuilt)
        except prebuilt_build.PrebuiltError as e:
            raise BuildError(str(e)) from None
        for p in sorted((dest / "prebuilt").rglob("*")):
            if p.is_file():
                digests[p.relative_to(dest).as_posix()] = file_digest(p)

    meta: dict = {
        "name": config.name,
        "id": f"_{config.python_name}_cuda_{content_id(digests)}",
        "version": config.version,
        "license": config.license,
    }
    if config.upstream:
        meta["upstream"] = config.upstream
    if config.source:
        meta["source"] = config.source
    meta["python-depends"] = list(config.python_depends)
    meta["backend"] = {"type": "cuda", "archs": list(config.archs)}
    meta["kernels-minver"] = KERNELS_MINVER
    meta["digest"] = {"algorithm": "sha256", "files": dict(sorted(digests.items()))}
    kernel_git = git_provenance(root, [config.package_rel, "build.toml"])
    if kernel_git is not None:
        meta["provenance"] = {"kernel-builder": {"version": BUILDER_VERSION}, "kernel": kernel_git}
    (dest / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")

    from kernels._rust import Metadata

    try:
        Metadata.read_from_file(dest / "metadata.json")
    except ValueError as e:  # a bug in this script, not in the user's input
        raise BuildError(f"kernels rejects the metadata.json this script wrote ({e}); fix build_bundle.py.") from e
    return meta


def build(root: Path, out: Path, prebuilt: dict | None = None) -> dict:
    """(Re)write out/torch-cuda from the sources; remove everything else in `out`. Returns the metadata."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{VARIANT}.new-", dir=out))
    tmp.chmod(0o755)
    try:
        meta = render_variant(root, tmp, prebuilt)
        final = out / VARIANT
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{VARIANT}.old-", dir=out))
            final.rename(old / VARIANT)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    for entry in sorted(out.iterdir()):
        if entry.name != VARIANT:
            print(f"removed stale {entry.relative_to(out.parent)}")
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return meta


def _tree_files(path: Path) -> dict[str, bytes]:
    if not path.is_dir():
        return {}
    files = {}
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and not _is_bytecode(rel):
            files[rel] = p.read_bytes()
    return files


def stale_reasons(root: Path, out: Path) -> list[str]:
    """Differences between `out` and a fresh build of `root`; empty when `out` is up to date."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp) / VARIANT
        fresh_dir.mkdir()
        render_variant(root, fresh_dir)
        fresh = _tree_files(fresh_dir)
    have = _tree_files(out / VARIANT)
    label = f"{out.name}/{VARIANT}"
    if not (out / VARIANT).is_dir():
        return [f"{label}/ does not exist"]
    reasons = [f"{label}/{rel} is missing" for rel in sorted(fresh.keys() - have.keys())]
    reasons += [f"{label}/{rel} is not part of the build" for rel in sorted(have.keys() - fresh.keys())]
    reasons += [f"{label}/{rel} differs" for rel in sorted(fresh.keys() & have.keys()) if fresh[rel] != have[rel]]
    reasons += [f"{out.name}/{e.name} is not part of the build" for e in sorted(out.iterdir()) if e.name != VARIANT]
    return reasons


def publish_archs(root: Path) -> list[str]:
    """The archs the declared prebuilt set is published for (``publish_archs`` of prebuilt_set.json)."""
    config = read_build_config(root)
    path = root / config.package_rel / "prebuilt_set.json"
    if not path.is_file():
        raise BuildError(f"{path} not found: run python scripts/prebuilt_set.py and commit it.")
    return list(json.loads(path.read_text())["publish_archs"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when build/ differs from a fresh build")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="repository root holding build.toml (default: this repo)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: <root>/build, with --prebuilt <root>/build-prebuilt)")
    parser.add_argument("--prebuilt", action="store_true", help="also compile the declared prebuilt set")
    parser.add_argument("--arch", action="append", default=None,
                        help="with --prebuilt: an arch to build (repeatable; default: the set's publish_archs)")
    parser.add_argument("--sample", type=int, default=None,
                        help="with --prebuilt: build only N configurations (one per kernel kind; CI)")
    parser.add_argument("--jobs", type=int, default=None, help="with --prebuilt: compile workers")
    parser.add_argument("--report", type=Path, default=None,
                        help="with --prebuilt: append one row per arch (objects, MB, build time) to this jsonl "
                             "file (benchmarks/results/prebuilt_size.jsonl feeds the README)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    out = (args.out or root / ("build-prebuilt" if args.prebuilt else "build")).resolve()
    prebuilt = None
    if args.prebuilt:
        if args.check:
            parser.error("--check compares the committed build/, which never holds prebuilt objects")
        if out == (root / "build").resolve():
            parser.error("--prebuilt must not write into build/ (git keeps the set, not the objects); "
                         "use --out or the default build-prebuilt/")
        prebuilt = dict(archs=args.arch or publish_archs(root), sample_size=args.sample, jobs=args.jobs,
                        report=args.report and args.report.resolve())
    elif args.report is not None:
        parser.error("--report needs --prebuilt (it reports the compiled set)")
    try:
        if args.check:
            reasons = stale_reasons(root, out)
            if not reasons:
                meta = json.loads((out / VARIANT / "metadata.json").read_text())
                print(f"{out.name}/ is up to date ({meta['id']})")
                return 0
            print(f"{out.name}/ is stale:", file=sys.stderr)
            for reason in reasons:
                print(f"  {reason}", file=sys.stderr)
            config = read_build_config(root)
            git = git_provenance(root, [config.package_rel, "build.toml"])
            if git is not None and git["dirty"]:
                print(f"{config.package_rel}/ or build.toml has uncommitted changes: commit them first, then "
                      f"{REBUILD_HINT}", file=sys.stderr)
            else:
                print(REBUILD_HINT, file=sys.stderr)
            return 1
        meta = build(root, out, prebuilt)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    git = meta.get("provenance", {}).get("kernel")
    state = "no git provenance" if git is None else f"kernel commit {git['commit'][:12]}" + (
        " DIRTY: commit the sources, then build again before committing build/" if git["dirty"] else " (clean)")
    print(f"built {out.name}/{VARIANT}: {len(meta['digest']['files'])} files, id {meta['id']}, {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
