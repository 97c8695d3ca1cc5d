"""Publish the committed build to a Hub kernel repo.

    python scripts/publish.py --repo-id ORG/NAME [--endpoint URL] [--dry-run] [--prebuilt [--arch A] [--sample N]
                              [--jobs J] [--report FILE]]

Uploads, with huggingface_hub and ``repo_type="kernel"``:

* ``CARD.md`` as ``README.md`` to ``main``, with front matter ``library_name: kernels`` and the license from
  build.toml (CARD.md itself carries no front matter, so the license has one source);
* ``build/`` (plus the same README.md) to branch ``v<version>`` of build.toml, deleting files under build/ on that
  branch that are not in this build. The repo and the branch are created when missing (the branch from main).

It refuses, with a non-zero exit, when the build cannot be trusted to be what git says it is: the variant's
files do not match the digest in its metadata.json (checked with kernels' own ``Digest.hash_variant``), the build
was made from uncommitted sources (``provenance.kernel.dirty``) or has no provenance, build/ is stale
(``build_bundle.py --check``), or build/ has uncommitted changes. ``--dry-run`` runs the same checks, prints the
operations and contacts nobody. The token comes from ``HF_TOKEN`` or ``huggingface-cli login``.

``--prebuilt`` uploads, instead of build/ itself, the same variant rendered again from the same sources plus the
compiled prebuilt set (``build_bundle.py --prebuilt``: ``prebuilt/<arch>/`` objects and manifest, in the
digest), built in a temporary directory after the checks above; a full set is first checked against a fresh
derivation (``scripts/prebuilt_set.py --check``). ``--sample N`` builds N configurations only (what CI runs, with
``--dry-run``); ``--report FILE`` appends each arch's size (objects, MB, build time) to a jsonl file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import build_bundle
from build_bundle import VARIANT, BuildError

CARD = "CARD.md"


class PublishError(Exception):
    """The publish cannot go ahead; the message says what to do."""


def _is_bytecode(rel: str) -> bool:
    return "__pycache__" in rel.split("/")[:-1] or rel.endswith(".pyc")


def verify_build(root: Path, build_dir: Path) -> dict:
    """All checks that must pass before anything is uploaded; returns the variant's metadata."""
    from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, Metadata

    variant = build_dir / VARIANT
    if not (variant / "metadata.json").is_file():
        raise PublishError(f"{variant}/metadata.json not found: there is no build to publish. "
                           f"{build_bundle.REBUILD_HINT.capitalize()}.")
    metadata = Metadata.read_from_file(variant / "metadata.json")
    if metadata.digest is None:
        raise PublishError(f"{variant}/metadata.json has no digest, so the upload cannot be verified. "
                           f"{build_bundle.REBUILD_HINT.capitalize()}.")
    try:
        metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
    except DigestValidationError as e:
        problems = "; ".join(str(v) for v in e.violations)
        raise PublishError(f"{variant} does not match the digest in its metadata.json ({problems}): the files "
                           f"were edited after the build. {build_bundle.REBUILD_HINT.capitalize()}.") from None
    provenance = metadata.provenance
    if provenance is None or provenance.kernel is None:
        raise PublishError(f"{variant}/metadata.json has no git provenance (built outside a git checkout?), so the "
                           "published build could not be traced to its sources. Build from a git checkout.")
    if provenance.dirty:
        raise PublishError(f"{variant} was built from uncommitted sources (provenance.kernel.dirty). Commit the "
                           f"sources, then {build_bundle.REBUILD_HINT}.")
    reasons = build_bundle.stale_reasons(root, build_dir)
    if reasons:
        raise PublishError("build/ is stale:\n  " + "\n  ".join(reasons) + f"\n{build_bundle.REBUILD_HINT}.")
    rel = build_dir.relative_to(root).as_posix() if build_dir.is_relative_to(root) else str(build_dir)
    status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all", "--", rel],
                            capture_output=True, text=True)
    if status.returncode != 0 or status.stdout.strip():
        raise PublishError(f"{rel}/ has uncommitted changes (or is not in a git checkout); commit build/ so that "
                           "what is published is what git records.\n" + status.stdout.rstrip())
    return json.loads((variant / "metadata.json").read_text())


def render_readme(root: Path, license_id: str) -> str:
    card = root / CARD
    if not card.is_file():
        raise PublishError(f"{card} not found: it becomes the Hub README. Write it (usage, functions, benchmarks, "
                           "source) and commit it.")
    text = card.read_text()
    if text.startswith("---"):
        raise PublishError(f"{card} starts with front matter; remove it: publish.py writes `library_name: kernels` "
                           "and the license from build.toml.")
    return f"---\nlibrary_name: kernels\nlicense: {license_id.lower()}\n---\n\n{text}"


def build_files(build_dir: Path) -> dict[str, Path]:
    """Files to upload, keyed by their path in the repo (build/...)."""
    return {f"build/{p.relative_to(build_dir).as_posix()}": p for p in sorted(build_dir.rglob("*"))
            if p.is_file() and not _is_bytecode(p.relative_to(build_dir).as_posix())}


def render_prebuilt(root: Path, dest: Path, archs: list[str] | None, sample_size: int | None,
                    jobs: int | None = None, report: Path | None = None) -> tuple[Path, dict]:
    """The build to upload with its prebuilt set, rendered into ``dest/build``; returns (dir, metadata)."""
    if sample_size is None:
        import prebuilt_set

        if prebuilt_set.main(["--check"]) != 0:
            raise PublishError("the committed prebuilt set is stale; run python scripts/prebuilt_set.py, commit "
                               f"it, then {build_bundle.REBUILD_HINT}")
    out = dest / "build"
    meta = build_bundle.build(root, out, prebuilt=dict(archs=archs or build_bundle.publish_archs(root),
                                                       sample_size=sample_size, jobs=jobs, report=report))
    return out, meta


def publish(root: Path, repo_id: str, endpoint: str | None, dry_run: bool, prebuilt: dict | None = None) -> int:
    build_dir = root / "build"
    config = build_bundle.read_build_config(root)
    meta = verify_build(root, build_dir)
    readme = render_readme(root, config.license)
    branch = f"v{config.version}"
    if prebuilt is not None:
        with tempfile.TemporaryDirectory() as tmp:
            upload_dir, meta = render_prebuilt(root, Path(tmp), **prebuilt)
            return _publish_files(root, repo_id, endpoint, dry_run, config, meta, readme, branch,
                                  build_files(upload_dir))
    return _publish_files(root, repo_id, endpoint, dry_run, config, meta, readme, branch, build_files(build_dir))


def _publish_files(root, repo_id, endpoint, dry_run, config, meta, readme, branch, files) -> int:
    kernel = meta["provenance"]["kernel"]
    print(f"publish {config.name} {branch} (id {meta['id']}, sources at commit {kernel['commit'][:12]}) "
          f"to {repo_id} at {endpoint or 'the default Hub endpoint'}")
    plan = [f"create kernel repo {repo_id} (if missing)",
            f"main: upload README.md (from {CARD}, {len(readme.encode())} bytes)",
            f"create branch {branch} from main (if missing)",
            f"{branch}: upload README.md"]
    plan += [f"{branch}: upload {path} ({p.stat().st_size} bytes)" for path, p in files.items()]
    plan.append(f"{branch}: delete files under build/ that this build does not have")
    for line in plan:
        print(f"  {line}")
    if dry_run:
        print("dry run: nothing uploaded")
        return 0

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi(endpoint=endpoint)
    api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
    main = api.create_commit(repo_id, repo_type="kernel", revision="main", commit_message="Update README from CARD.md",
                             operations=[CommitOperationAdd("README.md", readme.encode())])
    api.create_branch(repo_id, repo_type="kernel", branch=branch, exist_ok=True)
    remote = [f for f in api.list_repo_files(repo_id, repo_type="kernel", revision=branch) if f.startswith("build/")]
    operations = [CommitOperationAdd("README.md", readme.encode())]
    operations += [CommitOperationAdd(path, str(p)) for path, p in files.items()]
    operations += [CommitOperationDelete(f) for f in remote if f not in files]
    info = api.create_commit(repo_id, repo_type="kernel", revision=branch, operations=operations,
                             commit_message=f"Build {meta['id']} from {kernel['commit'][:12]}",
                             commit_description=f"Built by scripts/build_bundle.py from commit {kernel['commit']}.")
    print(f"main is at {main.oid}")
    print(f"{branch} is at {info.oid}")
    print(f'load it with: kernels.get_kernel("{repo_id}", version={config.version})')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo-id", required=True, help="ORG/NAME of the Hub kernel repo")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--dry-run", action="store_true", help="check and print the operations; upload nothing")
    parser.add_argument("--root", type=Path, default=build_bundle.ROOT, help="repository root (default: this repo)")
    parser.add_argument("--prebuilt", action="store_true", help="upload the build with its compiled prebuilt set")
    parser.add_argument("--arch", action="append", default=None, help="with --prebuilt: arch(s) to build")
    parser.add_argument("--sample", type=int, default=None, help="with --prebuilt: N configurations only (CI)")
    parser.add_argument("--jobs", type=int, default=None, help="with --prebuilt: compile workers")
    parser.add_argument("--report", type=Path, default=None,
                        help="with --prebuilt: append the set's size per arch to this jsonl file")
    args = parser.parse_args(argv)
    if args.repo_id.count("/") != 1:
        parser.error(f"--repo-id must be ORG/NAME, got {args.repo_id!r}")
    try:
        if args.report is not None and not args.prebuilt:
            parser.error("--report needs --prebuilt (it reports the compiled set)")
        prebuilt = dict(archs=args.arch, sample_size=args.sample, jobs=args.jobs,
                        report=args.report and args.report.resolve()) if args.prebuilt else None
        return publish(args.root.resolve(), args.repo_id, args.endpoint, args.dry_run, prebuilt)
    except (PublishError, BuildError) as e:
        print(f"error: refusing to publish: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # huggingface_hub errors: HTTP status, auth, network
        from huggingface_hub.errors import HfHubHTTPError

        if isinstance(e, HfHubHTTPError):
            print(f"error: the Hub refused an upload step: {e}\nCheck the token (HF_TOKEN) has write access to "
                  f"{args.repo_id}.", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
