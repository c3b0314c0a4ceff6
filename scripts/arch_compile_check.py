#!/usr/bin/env python3
"""Compile a compile-ahead manifest's kernels for other GPU architectures, on any machine (Triton ships ptxas; no GPU).

    python3 scripts/arch_compile_check.py MANIFEST [--targets cuda:80:32,cuda:100:32] [--one-per-kernel] [--out F]

The manifest (`rlkernel/backends/triton/precompile.py`; the H200's, e.g. benchmarks/h200_session29/call3/
precompile_manifest.json: the kernels a strict forward + backward + logprob head launched) holds each specialization
as recorded on its GPU; its options carry that GPU's architecture and that host's libdevice path, so each entry is
re-parsed for the target (the options the target's backend fills: "arch", the fp8 types, libdevice) and compiled
there. Gluon kernels (sm_90 only: warp specialisation, setmaxnreg, wgmma) are skipped on other targets, as their
gate skips them at run time. Per target: compiled, skipped (with the reason), failures (kernel: error), the matrix
instructions the PTX holds (mma.sync on sm_80, wgmma on sm_90, tcgen05 on sm_100), seconds. This says the kernels
build there; it says nothing of their bits (a GPU of that architecture, `gpu_session.py gpu_tests strict_recheck`).
Exit status 1 when any entry failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TARGET_OPTIONS = ("arch", "supported_fp8_dtypes", "deprecated_fp8_dot_operand_dtypes", "extern_libs")
_MMA = {"mma.sync": r"\bmma\.sync\.aligned", "wgmma": r"\bwgmma\.mma_async", "tcgen05": r"\btcgen05\.mma"}


def retarget(data: str) -> str:
    """An entry's specialization data without the options its recording target decided (the target re-fills them)."""
    obj = json.loads(data)
    for k in _TARGET_OPTIONS:
        obj.get("options", {}).pop(k, None)
    return json.dumps(obj)


def check(manifest: str, target: str, one_per_kernel: bool = False) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from rlkernel.backends.triton import precompile as P

    be, arch, warp = target.split(":")
    tgt = GPUTarget(be, int(arch) if arch.isdigit() else arch, int(warp))
    backend = make_backend(tgt)
    entries = P.load(manifest)["entries"]
    if one_per_kernel:
        seen, picked = set(), []
        for e in sorted(entries, key=lambda e: (e.get("seconds") or 0.0)):  # the quickest of each kernel
            if e["kernel"] not in seen:
                seen.add(e["kernel"])
                picked.append(e)
        entries = sorted(picked, key=lambda e: e["kernel"])
    out = {"target": target, "arch": P.target_arch(tgt), "entries": len(entries), "compiled": 0, "skipped": {},
           "failures": {}, "mma": {}, "kernels": {}}
    t0 = time.perf_counter()
    for e in entries:
        name = e["kernel"].rsplit(".", 2)[-2] + "." + e["kernel"].rsplit(".", 1)[-1]
        fn, why = P._resolve(e["kernel"])
        if fn is None:
            out["skipped"][why] = out["skipped"].get(why, 0) + 1
            continue
        if fn.is_gluon() and out["arch"] != "sm90":
            r = f"{name}: Gluon, sm_90 only (its gate keeps it off here)"
            out["skipped"][r] = out["skipped"].get(r, 0) + 1
            continue
        try:
            src, options = P._source(fn, retarget(e["data"]), backend)
            ptx = triton.compile(src, target=tgt, options=options.__dict__).asm.get("ptx", "")
        except Exception as ex:  # noqa: BLE001 -- a Python-level failure is this entry's finding (LLVM aborts kill us)
            out["failures"][f"{name} ({e['key'][:40]})"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            continue
        out["compiled"] += 1
        kinds = sorted(k for k, pat in _MMA.items() if re.search(pat, ptx))
        out["kernels"].setdefault(name, {"compiled": 0, "mma": kinds})["compiled"] += 1
        for k in kinds:
            out["mma"][k] = out["mma"].get(k, 0) + 1
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifest")
    ap.add_argument("--targets", default="cuda:80:32,cuda:100:32")
    ap.add_argument("--one-per-kernel", action="store_true", help="the quickest entry of each kernel only")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    if not Path(args.manifest).exists():
        raise SystemExit(f"no manifest at {args.manifest}")
    res = {"manifest": args.manifest, "targets": []}
    with tempfile.TemporaryDirectory() as cache:  # compile for real: never a cache hit from an earlier run
        os.environ["TRITON_CACHE_DIR"] = cache
        for t in args.targets.split(","):
            r = check(args.manifest, t.strip(), args.one_per_kernel)
            print(f"{r['target']}: {r['compiled']} compiled, {sum(r['skipped'].values())} skipped, "
                  f"{len(r['failures'])} failed, {r['seconds']} s; matrix instructions {r['mma']}", file=sys.stderr)
            res["targets"].append(r)
    import triton

    res["triton"] = triton.__version__
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 1 if any(r["failures"] for r in res["targets"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
