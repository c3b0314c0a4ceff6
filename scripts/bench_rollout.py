#!/usr/bin/env python3
"""Rollout throughput: vLLM with the rlkernel strict plugin vs stock vLLM (CPU or CUDA), same prompts.

One script; each engine runs in its own subprocess (vLLM reads its plugin list and env at
import, so one engine per process), the parent prints both figures and the ratio
strict/stock (tokens/s), plus a JSON line. Greedy-free sampling at T=1, ignore nothing:
both engines get identical prompts and max_tokens. Warm-up generate first, then timed runs.
The engines alternate for --rounds rounds (stock, strict, stock, strict, ...) and each keeps
its best run, so a slow spell of this shared machine does not land on one engine only; the
median of rounds is reported beside the best (`*_median`). Every timed generate carries a probe
(scripts/round_probe.py: CPU seconds of the engine's process tree per 1k tokens, the host's busy
fraction, Python GCs, the GPU's SM clock / power / utilisation from nvidia-smi), so rounds that
run slow can be told apart by what they cost (H200 session 19: the strict engine bimodal).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpu_session import last_json  # this script's directory is on sys.path
from round_probe import RoundProbe

WORKERS = ["strict", "stock", "stock_graphs", "strict_graphs", "strict_fa3_graphs",
           # the strict engine at rlkernel.row_segments=1 (plain GEMMs in the row-parallel layers: a TP=1 run's choice)
           "strict_rs1", "strict_graphs_rs1",
           # runner variants (issue 11): both engines on vLLM's V1 model runner. On CUDA the strict engine runs on V2
           # (vLLM 0.25's default; raw_logprobs + the model's sampler wrapper, vllm_compat.ContractLogprobSampler); until
           # session 24 it ran on V1 with raw_logits, which V2 refuses
           "stock_graphs_v1", "strict_graphs_v1"]
VARIANT_ENV = {"stock_graphs_v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "strict_graphs_v1": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
VARIANT_ARGS = {"strict_graphs_v1": (("logprobs_mode", "raw_logits"),)}


def _build(args):
    """(engine, prompts, sampling) for worker `args.worker`, warmed up by one small generate."""
    import os
    import random

    from vime.records import SamplingSpec
    from vime.rollout import RolloutConfig, VLLMRollout

    os.environ.update(VARIANT_ENV.get(args.worker, {}))
    engine = "rlkernel" if args.worker.startswith("strict") else "stock"
    eng = VLLMRollout(RolloutConfig(model=args.model, engine=engine, mode="strict" if engine == "rlkernel" else "native", dtype=args.dtype,
                                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=32,
                                    max_model_len=args.prompt_len + args.max_tokens + 8, enforce_eager="_graphs" not in args.worker,
                                    ops=(("attention", "fa3"),) if "_fa3" in args.worker else (),
                                    gpu_memory_utilization=args.gpu_memory_utilization, row_segments=1 if "_rs1" in args.worker else None,
                                    engine_args=VARIANT_ARGS.get(args.worker, ())))
    rng = random.Random(0)
    vocab = eng.llm.llm_engine.model_config.get_vocab_size()
    prompts = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    spec = SamplingSpec(max_tokens=args.max_tokens)
    eng.generate(prompts[:2], spec)  # warm-up
    return eng, prompts, spec


def _timed(eng, prompts, spec) -> tuple[int, float, dict]:
    """(generated tokens, seconds, the round's probe: round_probe.RoundProbe's CPU / host / GC / GPU-clock figures) of
    one generate of every prompt, the prefix cache emptied first."""
    eng.llm.reset_prefix_cache()
    with RoundProbe() as probe:  # its wall time is the generate's (measured first on exit)
        out = eng.generate(prompts, spec)
    toks = sum(len(c.response_ids) for c in out)
    return toks, probe.wall, probe.report(toks)


MARK = "@@bench "  # a served worker's replies on stdout (the engine may log there too)


def serve(args) -> None:
    """--paired's worker: build the engine once, say READY, then one timed generate per "gen" line on stdin."""
    eng, prompts, spec = _build(args)
    print(MARK + json.dumps({"ready": args.worker, "runner": _runner(eng)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "gen":
            break
        toks, dt, probe = _timed(eng, prompts, spec)
        print(MARK + json.dumps({"tokens": toks, "seconds": dt, "probe": probe}), flush=True)


def worker(args) -> None:
    eng, prompts, spec = _build(args)
    best, probes = None, []
    for _ in range(args.repeat):
        toks, dt, probe = _timed(eng, prompts, spec)
        best = max(best or 0.0, toks / dt)
        probes.append({"tokens_per_second": round(toks / dt, 1), **probe})
    rep = {"engine": args.worker, "tokens_per_second": best, "tokens": toks, "runner": _runner(eng), "probes": probes}
    if args.cprofile:  # host time by function for one more generate: where a host-bound engine spends its steps
        rep["cprofile"] = _cprofiled(lambda: eng.generate(prompts, spec), eng, args.cprofile)
    if args.profile:  # one more generate under torch's profiler (in-process engine: its kernels are seen here)
        rep["profile"] = _profiled(lambda: eng.generate(prompts, spec), eng, args.profile)
    print(json.dumps(rep))


def _runner(eng) -> dict:
    """Which vLLM model runner and scheduling the engine got (vLLM picks V1 or V2 by model and options)."""
    cfg = eng.llm.llm_engine.vllm_config
    return {"v2_model_runner": bool(cfg.use_v2_model_runner), "async_scheduling": cfg.scheduler_config.async_scheduling,
            "logprobs_mode": cfg.model_config.logprobs_mode, "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode)}


def _cprofiled(fn, eng, top: int) -> dict:
    """One call of fn under cProfile: its wall time, and the `top` functions by own time and by cumulative time."""
    import cProfile
    import pstats

    eng.llm.reset_prefix_cache()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)

    def rows(key):
        items = sorted(st.stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"fn": f"{Path(f).name}:{line}({name})", "calls": v[1], "tottime": round(v[2], 4), "cumtime": round(v[3], 4)}
                for (f, line, name), v in items]

    return {"wall_seconds": round(wall, 3), "by_tottime": rows(2), "by_cumtime": rows(3)}


def _profiled(fn, eng, top: int) -> dict:
    """Device time by kernel for one call of fn, the top `top` kernels, and the wall time under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng.llm.reset_prefix_cache()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    evs = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    evs.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in evs)
    return {"wall_seconds": round(wall, 3), "device_kernel_ms": round(total / 1e3, 1),
            "kernels": [{"name": e.key[:90], "calls": e.count, "ms": round(e.device_time_total / 1e3, 2)} for e in evs[:top]]}


def _code() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vime.stamp import code_stamp

    return code_stamp()


class _Served:
    """One engine in its own process (vLLM: one engine a process), driven over stdin/stdout."""

    def __init__(self, name: str, argv: list[str], log_dir: str):
        self.name = name
        self.log = open(Path(log_dir) / f"{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--serve", "--worker", name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)

    def reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.proc.wait()
        self.log.flush()
        tail = Path(self.log.name).read_text()[-3000:]
        raise SystemExit(f"bench_rollout --paired: engine {self.name} exited (rc {self.proc.returncode}); its log ends: {tail}")

    def generate(self) -> dict:
        self.proc.stdin.write("gen\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def _probe_line(p: dict | None) -> str:
    """A round's probe in a few words: CPU ms per 1k tokens, host busy, the SM clock's mean."""
    if not p:
        return "(no probe)"
    clock = p.get("gpu", {}).get("clocks.sm", {}).get("mean")
    return (f"cpu {p.get('cpu_ms_per_1k_tokens')} ms/1k tok, host busy {p.get('host_busy')}"
            + (f", sm {clock:.0f} MHz" if clock else ""))


def paired(args, engines: list[str]) -> dict:
    """Both engines alive at once (each its own process; on a GPU each takes --gpu-memory-utilization of it), their
    generates interleaved: each round runs one generate per engine, the order flipped every round (A B, B A, ...), so
    a slow or fast spell of the shared host lands on both; the ratio is per round, and the median of rounds is the
    figure. What an engine start costs, or how fast the host was when it started, no longer decides the ratio."""
    import tempfile

    if len(engines) != 2 or len(set(engines)) != 2:
        raise SystemExit(f"bench_rollout --paired: two different engines; got {engines}")
    # the ratio is the second over the first: stock first where one is stock, else as listed (e.g. strict_graphs_v1,
    # strict_graphs: the strict engine on V2 over itself on V1)
    swap = engines[1].startswith("stock") and not engines[0].startswith("stock")
    stock, strict = engines[::-1] if swap else engines
    argv = [a for a in sys.argv[1:] if a != "--paired"]
    log_dir = tempfile.mkdtemp(prefix="bench_rollout_")
    served, runners = {}, {}
    try:
        for w in (stock, strict):  # one at a time: each engine sizes its KV cache from the memory left when it starts
            served[w] = _Served(w, argv, log_dir)
            runners[w] = served[w].reply()["runner"]
            print(f"{w:>14} ready: {runners[w]}", flush=True)
        warmup = {}  # one untimed generate each first: an engine's first generate compiles its kernels for the shapes
        for w in (stock, strict):  # of this workload (Triton's JIT, vLLM's warm-up misses) and is not a round
            rep = served[w].generate()
            warmup[w] = round(rep["tokens"] / rep["seconds"], 1)
        print(f"warm-up (not a round): {stock} {warmup[stock]:.1f}, {strict} {warmup[strict]:.1f} tokens/s", flush=True)
        rounds = []
        for r in range(args.rounds):
            order = (stock, strict) if r % 2 == 0 else (strict, stock)
            row, probes = {}, {}
            for w in order:
                rep = served[w].generate()
                row[w] = round(rep["tokens"] / rep["seconds"], 1)
                probes[w] = rep.get("probe")
            ratio = row[strict] / row[stock]
            rounds.append({"order": list(order), **{f"{w}_tokens_per_second": v for w, v in row.items()}, "ratio": round(ratio, 4),
                           "probes": probes})
            print(f"round {r + 1} ({order[0]} first): {stock} {row[stock]:.1f}, {strict} {row[strict]:.1f} tokens/s, ratio "
                  f"{ratio:.3f}; " + ", ".join(f"{w} {_probe_line(probes[w])}" for w in (stock, strict)), flush=True)
    finally:
        for sv in served.values():
            sv.close()
    ratios = [x["ratio"] for x in rounds]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"paired": True, "stock": stock, "strict": strict, "warmup_tokens_per_second": warmup, "rounds_detail": rounds,
            "ratios": ratios, "ratio_median": round(statistics.median(ratios), 4), "ratio_quartiles": [round(q[0], 4), round(q[2], 4)],
            "ratio_geometric_mean": round(statistics.geometric_mean(ratios), 4), "ratio_min": min(ratios), "ratio_max": max(ratios),
            f"{stock}_median_tokens_per_second": statistics.median(x[f"{stock}_tokens_per_second"] for x in rounds),
            f"{strict}_median_tokens_per_second": statistics.median(x[f"{strict}_tokens_per_second"] for x in rounds),
            "logs": log_dir, "runners": runners}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3, help="timed generate calls per engine start")
    ap.add_argument("--rounds", type=int, default=2, help="engine starts per engine, alternating")
    ap.add_argument("--out", help="also write the JSON result to this file")
    ap.add_argument("--engines", default="stock,strict",
                    help="engines to time, alternating: strict (eager), stock (eager), stock_graphs (stock vLLM compiled, with "
                         "CUDA graphs, on a GPU), strict_graphs (the strict engine with decode CUDA graphs, on a GPU), "
                         "strict_fa3_graphs (strict_graphs with the FA3 attention contract: the loop's fastest strict arm; GPU, bf16), "
                         "strict_rs1 / strict_graphs_rs1 (the strict engine at rlkernel.row_segments=1)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed runs, profile one more generate per engine and keep its top N kernels by device time")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="one more generate per engine under cProfile: the top N functions by own and cumulative host time")
    ap.add_argument("--keep-going", action="store_true",
                    help="an engine that fails is recorded with its output's tail and left out of the ratios, not fatal")
    ap.add_argument("--paired", action="store_true",
                    help="both engines (one stock*, one strict*) alive at once, their generates interleaved for --rounds "
                         "rounds (order flipped each round); the ratio per round and its median")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="each engine's share of the GPU's memory (default: vLLM's; --paired on a GPU: 0.4)")
    ap.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return serve(args) if args.serve else worker(args)
    engines = args.engines.split(",")
    if set(engines) - set(WORKERS):
        ap.error(f"unknown engines {sorted(set(engines) - set(WORKERS))}; known: {WORKERS}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.paired:
        if args.gpu_memory_utilization is None:
            import torch

            if torch.cuda.is_available():
                sys.argv += ["--gpu-memory-utilization", "0.4"]
        result = {"code": _code(), "command": " ".join(sys.argv), "model": args.model, "dtype": args.dtype,
                  "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
                  **paired(args, engines)}
        print(f"median of {args.rounds} paired rounds: {result['strict']} / {result['stock']} = {result['ratio_median']:.3f}x "
              f"(range {result['ratio_min']:.3f}-{result['ratio_max']:.3f})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result))
        return
    res = {w: 0.0 for w in engines}
    per_round = {w: [] for w in engines}
    profiles, cprofiles, runners, failed = {}, {}, {}, {}
    for r in range(args.rounds):
        for w in engines:
            if w in failed:
                continue
            cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", w]
            p = subprocess.run(cmd, capture_output=True, text=True)
            rep = last_json(p.stdout) if p.returncode == 0 else None
            if rep is None:
                tail = (p.stdout + p.stderr)[-3000:]
                if not args.keep_going:
                    raise SystemExit(f"bench_rollout: engine {w} failed (rc {p.returncode}) or printed no JSON result; its output ended with: {tail}")
                failed[w] = {"rc": p.returncode, "tail": tail}
                print(f"round {r + 1} {w:>12}: FAILED rc={p.returncode}: {tail[-600:]}", flush=True)
                continue
            tps = rep["tokens_per_second"]
            runners.setdefault(w, rep.get("runner"))
            if "cprofile" in rep:
                cprofiles.setdefault(w, rep["cprofile"])
            if "profile" in rep:
                profiles.setdefault(w, rep["profile"])
            res[w] = max(res[w], tps)
            per_round[w].append(round(tps, 1))
            print(f"round {r + 1} {w:>12}: {tps:8.1f} tokens/s", flush=True)
    engines = [w for w in engines if w not in failed]
    res = {w: v for w, v in res.items() if w not in failed}
    per_round = {w: v for w, v in per_round.items() if w not in failed}
    ratios = {f"{s}_over_{w}": round(res[s] / res[w], 3) for s in engines if s.startswith("strict")
              for w in engines if w.startswith("stock")}
    # the median of rounds beside the best: engine starts on a shared host swing 1.3-2x between rounds (H200 session
    # 12), so one figure alone would flatter or wrong either side
    med = {w: statistics.median(v) for w, v in per_round.items()}
    med_ratios = {f"{s}_over_{w}_median": round(med[s] / med[w], 3) for s in engines if s.startswith("strict")
                  for w in engines if w.startswith("stock") and med[w] > 0}
    print("best: " + ", ".join(f"{w} {v:.1f}" for w, v in res.items()) + " tokens/s; " + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items())
          + "; median of rounds: " + ", ".join(f"{k} = {v:.2f}x" for k, v in med_ratios.items()))
    result = {"code": _code(), "command": " ".join(sys.argv), "model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "repeat": args.repeat, **{f"{w}_tokens_per_second": v for w, v in res.items()}, **ratios,
              **{f"{w}_median_tokens_per_second": v for w, v in med.items()}, **med_ratios,
              "per_round_tokens_per_second": per_round, "runners": runners, **({"failed": failed} if failed else {}),
              **({"profiles": profiles} if profiles else {}), **({"cprofiles": cprofiles} if cprofiles else {}),
              # device time of one profiled generate as a throughput ratio, stock / strict (< 1: strict spends more):
              # steadier than tokens/s on a host whose engine starts swing
              **{f"{s}_over_{w}_device_time": round(profiles[w]["device_kernel_ms"] / profiles[s]["device_kernel_ms"], 3)
                 for s in profiles if s.startswith("strict") for w in profiles if w.startswith("stock")
                 if profiles[s]["device_kernel_ms"] > 0},
              "ratio": ratios.get("strict_over_stock")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
