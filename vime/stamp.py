"""What code a result was measured with: the git commit (and whether the tree was dirty) and one sha256 over the
sources that decide the numbers (vime/, rlkernel/, recipes/, scripts/). Benchmarks and long runs write it into their
JSON, and `scripts/stale_results.py` lists the committed results whose sources have changed since.

A result from the device machine names a stale commit: its copy of the tree keeps the git metadata of the session's
first upload, so `commit` is that one and `dirty` is true. The source hash is the truth; `commit_for_sources` (and
`python -m vime.stamp which SHA256`) finds the commit whose sources hash to it, walking back from HEAD — none when the
sources that ran were never committed as they were."""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("vime", "rlkernel", "recipes", "scripts")
SUFFIXES = (".py", ".yaml", ".cpp", ".h", ".json")


def _sources(paths) -> list[PurePosixPath]:
    """The measured sources among `paths` (relative to the root), in the hash's order: folder by folder as SOURCES
    lists them, each folder's paths sorted as `Path`s sort (part by part)."""
    keep = [PurePosixPath(p) for p in paths]
    keep = [p for p in keep if p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return [p for folder in SOURCES for p in sorted((p for p in keep if p.parts[0] == folder), key=lambda p: p.parts)]


def _digest(files) -> str:
    """One sha256 over (relative path, bytes) pairs, each as path NUL bytes NUL."""
    h = hashlib.sha256()
    for path, data in files:
        h.update(str(path).encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def source_sha256(root: Path = ROOT) -> str:
    found = [f.relative_to(root).as_posix() for folder in SOURCES for f in (root / folder).rglob("*") if f.is_file()]
    return _digest((p, (root / p).read_bytes()) for p in _sources(found))


def _commit_source_sha256(root: Path, commit: str) -> str:
    """`source_sha256` of a commit's tree, read from git's objects: the same files in the same order, the same bytes."""
    ls = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "--", *SOURCES], cwd=root, capture_output=True,
                        check=True).stdout.decode().splitlines()
    order = _sources(ls)
    blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=root, capture_output=True, check=True,
                           input="".join(f"{commit}:{x}\n" for x in order).encode()).stdout

    def read():
        at = 0
        for x in order:
            end = blobs.index(b"\n", at)
            size = int(blobs[at:end].split()[2])
            yield x, blobs[end + 1:end + 1 + size]
            at = end + 1 + size + 1
    return _digest(read())


def commit_for_sources(sha256: str, root: Path = ROOT, max_commits: int = 300) -> str | None:
    """The newest of HEAD's last `max_commits` commits whose sources hash to `sha256` (`source_sha256`), or None."""
    revs = subprocess.run(["git", "rev-list", f"--max-count={max_commits}", "HEAD"], cwd=root, capture_output=True,
                          check=True).stdout.decode().split()
    seen: dict[str, str] = {}  # the source folders' tree ids -> their hash (commits that change only notes share one)
    for rev in revs:
        key = subprocess.run(["git", "ls-tree", rev, "--", *SOURCES], cwd=root, capture_output=True,
                             check=True).stdout.decode()
        if key not in seen:
            seen[key] = _commit_source_sha256(root, rev)
        if seen[key] == sha256:
            return rev
    return None


def code_stamp(root: Path = ROOT) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", *SOURCES)
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status), "source_sha256": source_sha256(root)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the code stamp of this checkout, or the commit of a recorded one")
    sub = ap.add_subparsers(dest="cmd")
    which = sub.add_parser("which", help="the commit whose sources hash to SHA256 (a record's code.source_sha256)")
    which.add_argument("sha256")
    which.add_argument("--max-commits", type=int, default=300)
    which.add_argument("--root", default=str(ROOT), help="the repository (default: this checkout)")
    args = ap.parse_args(argv)
    if args.cmd == "which":
        rev = commit_for_sources(args.sha256, Path(args.root), max_commits=args.max_commits)
        if rev is None:
            print(f"no commit of the last {args.max_commits} has these sources (the run's tree was never committed "
                  "as it was)", file=sys.stderr)
            return 1
        print(rev)
        return 0
    print(code_stamp())
    return 0


if __name__ == "__main__":
    sys.exit(main())
