#!/usr/bin/env python3
"""List the committed result files (benchmarks/*.json) whose recorded code stamp (vime.stamp: commit and source hash)
differs from this checkout's sources, or that record none. Informational: exit status 0; `--strict` exits 1 when any
is stale. Regenerate a stale result with the command its notes give (README "Benchmarks", benchmarks/H200_NOTES.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from vime.stamp import source_sha256

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true")
    args = ap.parse_args()
    now, stale = source_sha256(), 0
    for f in sorted((ROOT / "benchmarks").glob("*.json")):
        if f.name.endswith("_curves.json") and f.with_name(f.name[: -len("_curves.json")] + ".json").exists():
            continue  # `vime plot`'s sidecar of a run's curves: the run's own JSON carries the stamp
        try:
            stamp = json.loads(f.read_text()).get("code")
        except (json.JSONDecodeError, AttributeError):
            stamp = None
        if not isinstance(stamp, dict):
            state = "no code stamp"
        elif stamp.get("source_sha256") == now:
            state = "fresh"
        else:
            # the source hash identifies the code; the device machine's git metadata can lag the tree it was sent
            state = (f"stale (sources {str(stamp.get('source_sha256'))[:10]}, git {str(stamp.get('commit'))[:10]}"
                     f"{' dirty' if stamp.get('dirty') else ''})")
        stale += state != "fresh"
        print(f"{state:52s} {f.relative_to(ROOT)}")
    print(f"{stale} result file(s) not measured with these sources")
    return 1 if args.strict and stale else 0


if __name__ == "__main__":
    sys.exit(main())
