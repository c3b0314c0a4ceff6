"""`vime diagnose` against known causes, in its own process (vLLM in-process pins torch threads).
Run as `python tests/diagnose_checks.py MODEL_DIR`; prints one JSON object: for each case, the
site and op diagnose named first (or null), its cause, and the logprob mismatch count."""
import json
import sys

if __name__ == "__main__":
    import kernel_variants  # noqa: F401  (registers rms_norm implementation "variant")

    import rlkernel as rk
    from vime.diagnose import Diagnosis, Side

    def sides(rollout=None, trainer=None, threads=(1, 1)):
        return {"rollout": Side(mode="strict", ops=dict(rollout or {}), threads=threads[0]),
                "trainer": Side(mode="strict", ops=dict(trainer or {}), threads=threads[1])}

    cases = {"strict": sides()}
    for i, op in enumerate(rk.OPS):  # one op at a time on the production path, alternating the side
        cases[f"native:{op}"] = sides(rollout={op: "native"}) if i % 2 else sides(trainer={op: "native"})
    cases["reference_vs_cpu"] = sides(rollout={op: "reference" for op in rk.OPS}, trainer={op: "cpu" for op in rk.OPS})
    cases["threads_1_vs_2"] = sides(threads=(1, 2))
    cases["variant:rms_norm"] = sides(trainer={"rms_norm": "variant"})
    dg = Diagnosis(sys.argv[1], dtype="float32", temperature=0.9, seed=3, version=0,
                   sched=dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=8), sides=cases["strict"])
    try:
        dg.sample(10, seed=3, max_tokens=10)
        out = {}
        for name, s in cases.items():
            res = dg.run(s)
            f, why = res["first"], res["why"] or {}
            out[name] = {"site": f and f.site, "op": f and f.op, "inputs_equal": f and f.in_differ == 0, "cause": why.get("cause"),
                         "golden": why.get("golden"), "mismatch": res["stats"]["mismatch_count"], "tokens": res["stats"]["compared_tokens"],
                         "seen": {side: {op: sorted({e["impl"] for e in v}) for op, v in res["seen"][side].items()} for side in res["seen"]},
                         "kernels": why.get("kernels"),  # those each side named for the first divergence's op and layer
                         "layer0": {side: {op: res["kernels"][side].get((0, op), {}) for op in ("linear", "attention")}
                                    for side in res["kernels"]}}
    finally:
        dg.close()
    print(json.dumps(out))
