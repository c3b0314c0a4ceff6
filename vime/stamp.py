"""What code a result was measured with: the git commit (and whether the tree was dirty) and one sha256 over the
sources that decide the numbers (vime/, rlkernel/, recipes/, scripts/). Benchmarks and long runs write it into their
JSON, and `scripts/stale_results.py` lists the committed results whose sources have changed since."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("vime", "rlkernel", "recipes", "scripts")
SUFFIXES = (".py", ".yaml", ".cpp", ".h", ".json")


def source_sha256(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for folder in SOURCES:
        for f in sorted((root / folder).rglob("*")):
            if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def code_stamp(root: Path = ROOT) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", *SOURCES)
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status), "source_sha256": source_sha256(root)}
