#!/usr/bin/env python3
"""Make a recipe's kernel manifest seed from a GPU loop's manifests (rlkernel/backends/triton/precompile.py: a seed).

    python3 scripts/make_kernel_seed.py TAG_kernel_manifests.json --report TAG.json --out recipes/kernel_manifests/R.json.gz

TAG_kernel_manifests.json is what scripts/gpu_loop.py brings back ({arm: {file name: manifest}}); the arm (--arm,
default strict) gives the trainer's manifest (triton_kernels.json) and the engines' (triton_kernels_<engine>.json,
merged: every engine of a recipe runs the same kernels). TAG.json, the loop's report, says where they were recorded
(device, code, recipe, overrides), kept in the seed verbatim. A recipe points `trainer.kernel_manifest_seed` at the
result; a run merges it into its own manifests before the first step (a fresh machine then compiles ahead).

Record from a run without a seed (`strict:trainer.kernel_manifest_seed=null`; `scripts/gpu_session.py
loop_qwen3_strict_seed`): a seeded run's manifests hold every entry of the seed it merged, launched or not (a
preloaded kernel's launches are invisible to Triton's compile hooks), so a seed re-recorded from one carries the old
seed's stale entries forward (session 47: attention v1's SEG_CHUNKS 8 beside v2's 32). Such a run is refused unless
--allow-seeded, and the seed then names the seed it inherited (`recorded.seeded_from`). Entries the contracts no
longer launch (`precompile.contract_stale`: an attention kernel specialised for another KV split) are dropped and
counted in the output's `dropped`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlkernel.backends.triton import precompile  # noqa: E402


def seed_manifests(arm_files: dict) -> dict:
    """{role: manifest} from one arm's {file name: manifest}: triton_kernels.json is the trainer's, every
    triton_kernels_<engine>.json an engine's (their entries merged, deduplicated by kernel and Triton's key)."""
    out: dict = {}
    for name, m in sorted(arm_files.items()):
        if "unreadable" in m:
            raise ValueError(f"{name}: {m['unreadable']} (the loop's call ended while it was written: run it again)")
        role = "trainer" if name == "triton_kernels.json" else "engine" if name.startswith("triton_kernels_") else None
        if role is None:
            raise ValueError(f"{name}: neither the trainer's manifest nor an engine's")
        have = out.setdefault(role, {"format": m["format"], "triton": m["triton"], "entries": []})
        if m["triton"] != have["triton"]:
            raise ValueError(f"{name}: Triton {m['triton']}, the other {role} manifest {have['triton']}")
        keys = {(e["kernel"], e["key"]) for e in have["entries"]}
        have["entries"] += [e for e in m["entries"] if (e["kernel"], e["key"]) not in keys]
    return out


def drop_contract_stale(roles: dict) -> dict:
    """Remove, in place, the entries the contracts no longer launch (`precompile.launchable`); {reason: n}."""
    dropped: dict = {}
    for m in roles.values():
        m["entries"], stale = precompile.launchable(m["entries"])
        for why, n in stale.items():
            dropped[why] = dropped.get(why, 0) + n
    return dropped


def seeded_from(recipe: str, overrides: list | None) -> str | None:
    """The kernel manifest seed the recorded run merged before its first step (its recipe and overrides), or None."""
    from vime.config import load_config

    return load_config(recipe, list(overrides or []))[0].trainer.kernel_manifest_seed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("manifests", help="scripts/gpu_loop.py's <tag>_kernel_manifests.json")
    ap.add_argument("--report", required=True, help="the loop's <tag>.json (where the manifests were recorded)")
    ap.add_argument("--arm", default="strict")
    ap.add_argument("--out", required=True, help="the seed to write (.json.gz)")
    ap.add_argument("--allow-seeded", action="store_true",
                    help="accept manifests of a run that merged a seed (its entries, stale ones too, are carried "
                         "forward)")
    args = ap.parse_args(argv)
    arms = json.loads(Path(args.manifests).read_text())
    if args.arm not in arms:
        raise SystemExit(f"{args.manifests}: no arm {args.arm!r} (it has {sorted(arms)})")
    report = json.loads(Path(args.report).read_text())
    recorded = {"from": Path(args.manifests).name, "arm": args.arm,
                **{k: report.get(k) for k in ("recipe", "device", "torch", "code")},
                "overrides": (report.get("overrides") or {}).get(args.arm)}
    inherited = seeded_from(report["recipe"], recorded["overrides"])
    if inherited and not args.allow_seeded:
        raise SystemExit(f"{args.report}: the {args.arm} arm ran with trainer.kernel_manifest_seed={inherited}, so its "
                         "manifests hold that seed's entries too, stale ones included; record from a run with "
                         f"{args.arm}:trainer.kernel_manifest_seed=null (gpu_session.py loop_qwen3_strict_seed), or "
                         "pass --allow-seeded")
    if inherited:
        recorded["seeded_from"] = inherited
    roles = seed_manifests(arms[args.arm])
    dropped = drop_contract_stale(roles)
    counts = precompile.make_seed(args.out, roles, recorded)
    print(json.dumps({"seed": args.out, "entries": counts, "dropped": dropped, "recorded": recorded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
