"""Download a kernel repo into the Hugging Face cache so that every offline load works.

    python scripts/prefetch.py ORG/NAME --version 1          # default
    python scripts/prefetch.py ORG/NAME --revision <commit|branch>
    python scripts/prefetch.py ORG/NAME --lockfile kernels.lock
    options: --endpoint URL (default $HF_ENDPOINT or the Hub), --cache-dir DIR (default $KERNELS_CACHE, else
             the huggingface_hub cache), --trust-remote-code (skip the publisher trust check)

Why: with kernels 0.17.2 an online ``get_kernel(repo, version=1)`` downloads only the variant's files by commit.
It writes no ``refs/v1`` (so an offline ``version=1`` fails) and caches the full tree listing of the commit (so the
offline snapshot lookup that kernels does sees the other files, e.g. README.md, as missing and fails). This script
does what huggingface_hub does for a complete snapshot: ``snapshot_download(revision="v1")`` of the whole repo,
which writes ``refs/v1`` and every file of the commit. Afterwards, with HF_HUB_OFFLINE=1,
``get_kernel(repo, version=1)``, ``get_kernel(repo, revision=<commit>)``, ``get_kernel(repo, revision="v1")``
and ``load_kernel(repo, lockfile=...)`` all load from the cache.

Offline loads skip the publisher trust check (kernels assumes it happened at download time), so this script
checks it, like ``get_kernel`` does online, unless --trust-remote-code is given. It also verifies every variant's
files against the sha256 digest in its metadata.json. Prints the commit on stdout (progress goes to stderr).
Needs only huggingface_hub and kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from kernels._rust import Digest, DigestAlgorithm, DigestValidationError, KernelLocks, Metadata

# The same patterns kernels passes to snapshot_download, so the cached listing check agrees with it.
BYTECODE_PATTERNS = ["*.pyc", "**/__pycache__/**"]


class PrefetchError(Exception):
    """Something the user has to fix; the message says what."""


def locked_commit(lockfile: Path, repo_id: str) -> str:
    try:
        locks = KernelLocks.from_json(lockfile.read_text())
    except (OSError, ValueError) as e:
        raise PrefetchError(f"cannot read lock file {lockfile}: {e}. Create it with `kernels lock <project>`.")
    for dep, lock in locks.items():
        if dep.repo_id == repo_id:
            return lock.commit
    raise PrefetchError(f"{lockfile} has no entry for {repo_id} (it locks {[d.repo_id for d in locks.keys()]}). "
                        f"Add {repo_id} to [tool.kernels.dependencies] and run `kernels lock <project>`.")


def check_trust(api: HfApi, repo_id: str) -> None:
    org = repo_id.split("/", 1)[0]
    try:
        overview = api.get_organization_overview(org)
    except HfHubHTTPError as e:
        raise PrefetchError(f"could not verify that '{org}' is a trusted kernel publisher ({e.__class__.__name__}). "
                            "Pass --trust-remote-code if you trust this repository's code.") from None
    if not getattr(overview, "trustedKernelPublisher", False):
        raise PrefetchError(f"'{org}' is not a trusted kernel publisher on the Hub, and offline loads skip this "
                            f"check. Pass --trust-remote-code if you trust the code of {repo_id}.")


def verify_variants(snapshot: Path) -> list[str]:
    """Check each build variant's files against its metadata digest; return the variant names."""
    variants = sorted(p for p in (snapshot / "build").iterdir() if (p / "metadata.json").is_file()) \
        if (snapshot / "build").is_dir() else []
    if not variants:
        raise PrefetchError(f"{snapshot} has no build/<variant>/metadata.json: this revision holds no kernel build. "
                            "Pick the version branch (--version N) rather than main.")
    for variant in variants:
        metadata = Metadata.read_from_file(variant / "metadata.json")
        if metadata.digest is None:
            print(f"note: {variant.name} has no digest in metadata.json; its files are not verified", file=sys.stderr)
            continue
        try:
            metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
        except DigestValidationError as e:
            problems = "; ".join(str(v) for v in e.violations)
            raise PrefetchError(f"{variant} does not match its metadata digest ({problems}). The download is "
                                "corrupt or the publisher's build is broken; delete the snapshot and retry, or "
                                "report it to the publisher.") from None
    return [v.name for v in variants]


def prefetch(repo_id: str, revision: str, *, endpoint: str | None, cache_dir: str | None,
             trust_remote_code: bool) -> tuple[str, Path]:
    if constants.HF_HUB_OFFLINE:
        raise PrefetchError("HF_HUB_OFFLINE is set, but prefetching needs the Hub. Unset it for this command.")
    api = HfApi(endpoint=endpoint, library_name="kernels-prefetch")
    if not trust_remote_code:
        check_trust(api, repo_id)
    try:
        snapshot = Path(api.snapshot_download(repo_id, repo_type="kernel", revision=revision, cache_dir=cache_dir,
                                              ignore_patterns=BYTECODE_PATTERNS))
    except RepositoryNotFoundError:
        raise PrefetchError(f"kernel repo {repo_id} not found at {api.endpoint}. Check the repo id (ORG/NAME) "
                            "and your token for private repos.") from None
    except RevisionNotFoundError:
        raise PrefetchError(f"{repo_id} has no revision {revision!r}. List its versions with "
                            f"`kernels versions {repo_id}`.") from None
    commit = snapshot.name
    variants = verify_variants(snapshot)
    ref = snapshot.parent.parent / "refs" / revision
    if revision != commit and ref.read_text().strip() != commit:
        raise PrefetchError(f"{ref} does not point to {commit} after the download; remove {snapshot.parent.parent} "
                            "and retry.")
    print(f"prefetched {repo_id} {revision} -> {commit} ({', '.join(variants)}) into {snapshot}", file=sys.stderr)
    return commit, snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repo_id", help="ORG/NAME of the kernel repo")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="kernel version N (branch vN); the default is 1")
    which.add_argument("--revision", help="a commit hash or branch name")
    which.add_argument("--lockfile", type=Path, help="a kernels.lock: prefetch the commit it locks for ORG/NAME")
    parser.add_argument("--endpoint", default=None, help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--cache-dir", default=None, help="cache directory (default: $KERNELS_CACHE, else the "
                                                          "huggingface_hub cache, $HF_HUB_CACHE)")
    parser.add_argument("--trust-remote-code", action="store_true", help="skip the publisher trust check")
    args = parser.parse_args(argv)
    if args.repo_id.count("/") != 1:
        parser.error(f"repo_id must be ORG/NAME, got {args.repo_id!r}")
    try:
        if args.lockfile is not None:
            revision = locked_commit(args.lockfile, args.repo_id)
        elif args.revision is not None:
            revision = args.revision
        else:
            revision = f"v{args.version if args.version is not None else 1}"
        commit, _ = prefetch(args.repo_id, revision, endpoint=args.endpoint,
                             cache_dir=args.cache_dir or os.environ.get("KERNELS_CACHE") or None,
                             trust_remote_code=args.trust_remote_code)
    except PrefetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(commit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
