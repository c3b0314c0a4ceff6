"""The golden-bits suite: every strict op, fp32 and bf16, forward and backward, hashed.

What this module decides: a small fixed set of strict computations whose output bits every
machine must reproduce. Inputs are built from integers (never `torch.randn`, whose bits may
depend on the ISA), outputs are hashed (sha256 of their bytes), and the hashes are committed
in `golden.json` with the contract id of each op they were made under. `make test` checks
every implementation against them (tests/test_golden.py), so a machine that computes other
bits — another ISA, thread count, BLAS or compiler — fails loudly; the CPU kernels run the
cases marked `slice` at load (`self_check`). Regenerating (`python -m rlkernel.golden --write`)
is refused unless the contracts changed, i.e. a contract version was bumped.

The GPU contracts (family `triton-sm90`, rlkernel/contracts/gpu.py) sum in the tensor cores' steps, so their bits are
another set: the same cases run on a CUDA device by the Triton implementation are hashed per GPU architecture in
`contracts/gpu_golden.json` (recorded on that GPU: `python -m rlkernel.golden --record-gpu`), and the Triton backend
checks the slice at its first use on a device of that architecture (`gpu_self_check`; `RLKERNEL_GPU_GOLDEN=warn`
or `off` relaxes it, and the run's provenance says so). An architecture with no entry runs unverified, and says so.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

GOLDEN = Path(__file__).with_name("golden.json")
GPU_GOLDEN = Path(__file__).parent / "contracts" / "gpu_golden.json"
_GOLDEN_OPS = ("linear", "rms_norm", "swiglu", "rope", "attention", "linear_logprob")


class GoldenMismatch(RuntimeError):
    """An implementation's bits differ from the committed golden hash of a case."""


def ints(*shape: int, seed: int = 0, scale: float = 1 / 64, dtype=torch.float32) -> torch.Tensor:
    """Deterministic values from integers: ((i * 7919 + seed * 104729) % 2003 - 1001) * scale."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = ((i * 7919 + seed * 104729) % 2003 - 1001).to(torch.float64) * scale
    return v.to(torch.float32).to(dtype).reshape(shape)


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # the contract it exercises
    fn: Callable[[], list[torch.Tensor]]  # returns the outputs to hash
    slice: bool = False  # run by the load-time self-check (fast with the kernels)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = ints(*out.shape, seed=seed, scale=1 / 512).to(out.dtype)
    return list(torch.autograd.grad(out, inputs, g))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _cases() -> list[Case]:
    import rlkernel as rk

    cases = []
    for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        def linear(dt=dt, segs=1):
            x, w, b = _leaf(ints(5, 72, seed=1, dtype=dt)), _leaf(ints(33, 72, seed=2, scale=1 / 256, dtype=dt)), _leaf(ints(33, seed=3, dtype=dt))
            y = rk.linear(x, w, b, k_segments=segs)
            return [y, *_grads(y, [x, w, b], 4)]

        def big_linear(dt=dt):  # a K and N where vendor GEMMs change order with threads
            with torch.no_grad():
                return [rk.linear(ints(3, 1000, seed=5, dtype=dt), ints(300, 1000, seed=6, scale=1 / 512, dtype=dt))]

        def norm(dt=dt):
            x, w, r = _leaf(ints(5, 70, seed=7, dtype=dt)), _leaf((ints(70, seed=8) + 20).to(dt)), _leaf(ints(5, 70, seed=9, dtype=dt))
            y, h = rk.rms_norm(x, w, 1e-6, residual=r)
            return [y, h, *_grads(y, [x, w, r], 10)]

        def swiglu(dt=dt):
            a, b = _leaf(ints(5, 70, seed=11, scale=1 / 16, dtype=dt)), _leaf(ints(5, 70, seed=12, dtype=dt))
            y = rk.swiglu(a, b)
            return [y, *_grads(y, [a, b], 13)]

        def rope(dt=dt):
            x = _leaf(ints(6, 2, 16, seed=14, dtype=dt))
            y = rk.rope(x, torch.tensor([0, 1, 2, 300, 301, 700]), 1e4)
            return [y, *_grads(y, [x], 15)]

        def attention(dt=dt):
            q, k, v = (_leaf(ints(40, h, 16, seed=16 + i, scale=1 / 128, dtype=dt)) for i, h in enumerate((4, 2, 2)))
            cu = torch.tensor([0, 7, 40])
            y = rk.attention_varlen(q, k, v, cu)
            return [y, *_grads(y, [q, k, v], 19)]

        def decode(dt=dt):
            q, k, v = (ints(40, h, 16, seed=16 + i, scale=1 / 128, dtype=dt) for i, h in enumerate((4, 2, 2)))
            kc, vc = torch.zeros(6, 8, 2, 16, dtype=dt), torch.zeros(6, 8, 2, 16, dtype=dt)
            table = torch.tensor([[4, 0, 5, 1, 3]])
            slots = torch.cat([table[0, t // 8:t // 8 + 1] * 8 + t % 8 for t in range(33)])
            rk.write_kv_cache(k[7:], v[7:], kc, vc, slots)
            with torch.no_grad():
                return [rk.attention_paged(q[37:40], kc, vc, table, torch.tensor([33]), torch.tensor([0, 3]))]

        def logprob(dt=dt):
            h, w = _leaf(ints(6, 24, seed=20, dtype=dt)), _leaf(ints(1100, 24, seed=21, scale=1 / 256, dtype=dt))
            t = torch.tensor([0, 5, 511, 512, 1049, 700])
            lp = rk.linear_logprob(h, w, t, 0.8, vocab_size=1050)
            ent = rk.linear_entropy(h, w, 0.8, vocab_size=1050)
            with torch.no_grad():
                full = rk.linear_logprobs_full(h, w, 0.8, vocab_size=1050)
            return [lp, ent, full, *_grads(lp + ent, [h, w], 22)]

        cases += [Case(f"linear_{tag}", "linear", linear, slice=True), Case(f"linear_seg4_{tag}", "linear", lambda dt=dt: linear(dt, 4)),
                  Case(f"linear_k1000_{tag}", "linear", big_linear, slice=True),
                  Case(f"rms_norm_{tag}", "rms_norm", norm, slice=True), Case(f"swiglu_{tag}", "swiglu", swiglu, slice=True),
                  Case(f"rope_{tag}", "rope", rope, slice=True), Case(f"attention_{tag}", "attention", attention),
                  Case(f"attention_paged_{tag}", "attention", decode, slice=True), Case(f"linear_logprob_{tag}", "linear_logprob", logprob)]
    return cases


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:24]


def compute(impl: str, only_slice: bool = False, device: str = "cpu", record_errors: bool = False) -> dict[str, str]:
    """{case: hash} with the strict contracts run by implementation `impl`, inputs built on `device` (the same
    integer-built values everywhere). record_errors: a case that raises is hashed as "!" + the exception's type (an
    implementation that lacks a case on one GPU is recorded as such, and a later error in a case that ran is a
    difference); else it raises."""
    import rlkernel as rk

    out = {}
    # the cases differentiate: run them with autograd on even when loaded from an inference
    # region (vLLM's model runner, a no_grad scorer)
    on = contextlib.nullcontext() if device == "cpu" else torch.device(device)  # factories (ints, torch.tensor) there
    with torch.inference_mode(False), torch.enable_grad(), rk.mode("strict", impl=impl), on:
        for c in _cases():
            if c.slice or not only_slice:
                try:
                    out[c.name] = digest(c.fn())
                except Exception as e:  # noqa: BLE001 -- recorded, compared like a hash
                    if not record_errors:
                        raise
                    out[c.name] = f"!{type(e).__name__}"
    return out


def contract_ids() -> dict[str, str]:
    import rlkernel as rk

    return {op: rk.contract_for(op, "reference").contract_id for op in _GOLDEN_OPS}


def committed() -> dict:
    return json.loads(GOLDEN.read_text())


def check(impl: str, only_slice: bool = False) -> list[str]:
    """The cases whose bits differ from the committed hashes ("name (op, contract)"), [] if none."""
    want, ops = committed()["cases"], {c.name: c.op for c in _cases()}
    got = compute(impl, only_slice)
    return [f"{name} (op {ops[name]})" for name, h in got.items() if want.get(name) != h]


def check_impls(impls: dict[str, str], only_slice: bool = False, threads: int | None = None) -> dict[str, list[str]]:
    """{op: [cases whose bits differ]} with each op's cases run by implementation `impls[op]`
    (an op -> implementation map, as one engine's policy resolves it; ops left out are not
    checked — native ops have no golden bits), at `threads` torch threads when given (an
    engine's own count: an implementation may keep its contract at one count and not another).
    Read-only: what `vime doctor` and `vime diagnose` run per engine."""
    import rlkernel as rk

    want, bad = committed()["cases"], {op: [] for op in impls}
    old = torch.get_num_threads()
    if threads is not None:
        torch._C.set_num_threads(threads)  # the builtin: vLLM's CPU worker replaces torch.set_num_threads in its process
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for c in _cases():
                if c.op in impls and (c.slice or not only_slice):
                    with rk.mode("strict", impl="auto", ops={c.op: impls[c.op]}):
                        if digest(c.fn()) != want.get(c.name):
                            bad[c.op].append(c.name)
    finally:
        torch._C.set_num_threads(old)
    return bad


def self_check(impl: str) -> str:
    """The load-time check: the golden slice under `impl`; raises GoldenMismatch naming the cases."""
    bad = check(impl, only_slice=True)
    if bad:
        raise GoldenMismatch(f"implementation {impl!r} differs from the committed golden bits in: {', '.join(bad)}")
    return f"{sum(c.slice for c in _cases())} golden cases reproduced"


def gpu_arch(device=None) -> str:
    """The CUDA device's architecture as the GPU golden file keys it ("sm_90")."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def gpu_contract_ids() -> dict[str, str]:
    from .contracts import gpu as G

    return {op: G.BY_OP[op].contract_id for op in _GOLDEN_OPS}


def gpu_committed(path: Path | None = None) -> dict:
    path = path or GPU_GOLDEN
    return json.loads(path.read_text()) if path.exists() else {}


def _versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__}


def _gpu_differences(only_slice: bool, arch: str | None, path: Path | None, impl: str, device: str):
    """(this architecture's committed entry or None, its stale ops, {case: (recorded, now)} for the cases that differ).
    No entry: nothing runs. Compared: the cases the entry holds whose op's contract is still the one they were
    recorded under (a newer contract makes its recorded bits stale, not wrong)."""
    entry = gpu_committed(path).get(arch or gpu_arch())
    if entry is None:
        return None, [], {}
    stale = stale_ops(entry)
    got = compute(impl, only_slice, device=device, record_errors=True)
    want, ops = entry["cases"], {c.name: c.op for c in _cases()}
    return entry, stale, {name: (want[name], h) for name, h in got.items()
                          if name in want and ops[name] not in stale and want[name] != h}


def check_gpu(only_slice: bool = True, *, arch: str | None = None, path: Path | None = None, impl: str = "triton",
              device: str = "cuda") -> tuple[dict | None, list[str]]:
    """(the committed entry for this GPU's architecture or None, the cases whose bits differ from it, each as
    "name (recorded hash, hash now)"). No entry: (None, []) and nothing runs; stale ops are not compared."""
    entry, _, differ = _gpu_differences(only_slice, arch, path, impl, device)
    return entry, _described(differ)


def _described(differ: dict) -> list[str]:
    return [f"{name} ({want} recorded, {got} now)" for name, (want, got) in differ.items()]


def stale_ops(entry: dict) -> list[str]:
    """The ops whose GPU contract changed since `entry` was recorded (their hashes need a new record)."""
    ids = gpu_contract_ids()
    return sorted(op for op in _GOLDEN_OPS if entry["contracts"].get(op) != ids[op])


def check_gpu_by_op(ops, *, arch: str | None = None, path: Path | None = None, impl: str = "triton",
                    device: str = "cuda") -> dict[str, list[str] | None]:
    """{op: [cases whose bits differ]} for `ops` on this GPU against its architecture's committed hashes (every case,
    not just the slice); None for an op with nothing to compare: no entry for the architecture, or a contract changed
    since it was recorded. What `vime doctor` prints for a GPU engine."""
    entry, stale, differ = _gpu_differences(False, arch, path, impl, device)
    if entry is None:
        return {op: None for op in ops}
    by_case = {c.name: c.op for c in _cases()}
    return {op: None if op in stale else [name for name in differ if by_case[name] == op] for op in ops}


def gpu_self_check(*, arch: str | None = None, path: Path | None = None, impl: str = "triton", device: str = "cuda") -> str:
    """The Triton backend's load-time check on a CUDA device: raises GoldenMismatch naming the cases that differ
    from the architecture's committed hashes; says so when the architecture has none, or when an op's contract
    changed since they were recorded (that op unverified until `--record-gpu`)."""
    arch = arch or gpu_arch()
    entry, stale, differ = _gpu_differences(True, arch, path, impl, device)
    if entry is None:
        return f"unverified: no golden bits committed for {arch} ({(path or GPU_GOLDEN).name})"
    if differ:
        raise GoldenMismatch(f"the GPU kernels on {arch} differ from the golden bits recorded there (with "
                             f"{entry.get('versions')}) in: {'; '.join(_described(differ))}")
    n = sum(1 for c in _cases() if c.slice and c.name in entry["cases"] and c.op not in stale)
    return f"{n} golden cases reproduced ({arch})" + (f"; unverified (contract changed since recorded): {', '.join(stale)}"
                                                      if stale else "")


def record_gpu(*, force: bool = False, path: Path | None = None, impl: str = "triton", device: str = "cuda",
               arch: str | None = None) -> dict:
    """Record this GPU architecture's hashes of every case. An entry with other hashes under the same contracts is
    not replaced unless `force` (a compiler or driver that changes bits is a finding, not a new normal)."""
    path = path or GPU_GOLDEN
    arch = arch or gpu_arch()
    data = gpu_committed(path)
    hashes = compute(impl, device=device, record_errors=True)
    ids = gpu_contract_ids()
    old = data.get(arch)
    if old is not None and not force:
        changed = set(stale_ops(old))
        differ = sorted({c.op for c in _cases() if old["cases"].get(c.name) != hashes.get(c.name)})
        if not set(differ) <= changed:
            raise SystemExit(f"refused: on {arch} the bits of {differ} differ from the recorded ones under the same "
                             f"contracts (recorded with {old.get('versions')}, now {_versions() if impl == 'triton' else impl}); "
                             "pass --force to replace them, and say why in the commit")
    data[arch] = {"contracts": ids, "versions": _versions() if impl == "triton" else {"impl": impl},
                  "cases": hashes}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data[arch]


def write() -> None:
    """Regenerate golden.json from the reference composition; refused when no contract changed."""
    ids, hashes = contract_ids(), compute("reference")
    if GOLDEN.exists():
        old = committed()
        changed = [op for op in _GOLDEN_OPS if old["contracts"].get(op) != ids[op]]
        differ = sorted({c.op for c in _cases() if old["cases"].get(c.name) != hashes[c.name]})
        if not set(differ) <= set(changed):
            raise SystemExit(f"refused: the bits of {differ} changed but their contracts did not ({changed} did); "
                             "bump the contract's version in rlkernel/contracts/ first")
    GOLDEN.write_text(json.dumps({"contracts": ids, "cases": hashes}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(hashes)} cases)")


if __name__ == "__main__":  # python -m rlkernel.golden [--write | --record-gpu [--force] | --check-gpu]
    if "--write" in sys.argv:
        write()
    elif ("--record-gpu" in sys.argv or "--check-gpu" in sys.argv) and not torch.cuda.is_available():
        sys.exit("rlkernel.golden: --record-gpu and --check-gpu run the Triton kernels on a CUDA device; none here")
    elif "--record-gpu" in sys.argv:
        e = record_gpu(force="--force" in sys.argv)
        errors = {k: v for k, v in e["cases"].items() if v.startswith("!")}
        print(json.dumps({"recorded": gpu_arch(), "cases": len(e["cases"]), "errors": errors, "versions": e["versions"],
                          "file": str(GPU_GOLDEN)}))
    elif "--check-gpu" in sys.argv:
        entry, bad = check_gpu(only_slice=False)
        print(json.dumps({"arch": gpu_arch(), "entry": entry is not None, "differ": bad}))
        sys.exit(1 if bad else 0)
    else:
        for impl in ("reference", "cpu"):
            print(impl, check(impl) or "all golden cases reproduced")
