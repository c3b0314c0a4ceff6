"""Whether a strict run's step really ran strict: the verdict on its per-step provenance.

What this module decides: when a run that asked for `rlkernel.mode=strict` is marked failed.
A step fails when either engine's provenance shows a native op (even one a per-op override
asked for: the run is then an ablation, not strict), an implementation rlkernel does not
verify (not one of its own strict implementations: a plugin's kernel, say), or a fallback (a
later strict implementation than the device's first choice, e.g. the reference composition
because the CPU kernels did not load). The metrics line carries `strict_ok` (null for a
native run) and `strict_violations`; `vime doctor --run RUN_DIR` explains them.
"""
from __future__ import annotations

import rlkernel as rk
from rlkernel.dispatch import first_strict

VERIFIED = ("cpu", "reference", "triton", "fa3")  # rlkernel's strict implementations (golden/self-checked, tested)


def strict_status(mode: str, side_ops: dict[str, tuple], provenance: dict) -> dict:
    """{strict_ok, strict_violations} of one step. side_ops: {"rollout": ((op, choice), ...), "trainer": ...}."""
    if mode != "strict":
        return {"strict_ok": None, "strict_violations": []}
    problems = []
    for side in ("rollout", "trainer"):
        policy = rk.ExecutionPolicy(mode=mode, ops=side_ops.get(side, ()))
        for op, entries in sorted((provenance.get(side) or {}).items()):
            for e in entries:
                first = first_strict(op, e["device"])
                if e["backend"] == "native" or e["impl"] == "native":
                    asked = policy.choice(op) == "native"
                    problems.append(f"{side} ran {op} native" + (f" (asked for by a per-op override: {op}=native)" if asked else ""))
                elif e["impl"] not in VERIFIED:
                    problems.append(f"{side} ran {op} on implementation {e['impl']!r}, which rlkernel does not verify")
                elif policy.choice(op) == "strict" and e["impl"] != first:
                    problems.append(f"{side} ran {op} on {e['impl']!r}: a fallback from {first!r} on {e['device']}")
    return {"strict_ok": not problems, "strict_violations": problems}
