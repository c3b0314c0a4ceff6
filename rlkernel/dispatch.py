"""Selection: mode -> contract; device + availability -> implementation; provenance.

What this module decides: which implementation runs each op call, and what is recorded
about it. The one selection mechanism is `rlkernel.mode(...)`, a context manager over a
`contextvars.ContextVar`: it nests, it is restored on any exception, and threads/async tasks
do not leak into each other. A mode picks the *contract* ("strict" or "native", per op if
wanted); the device and what is available pick the *implementation* of that contract:

  strict on CPU:  "cpu" (C++ kernels, rlkernel/backends/cpu) when built and self-checked,
                  else "reference" (the torch composition: same contract, same bits, slower)
  strict on CUDA: "triton" (Triton kernels under the GPU contracts, rlkernel/contracts/gpu.py)
                  when triton and a CUDA device are present, else "reference" (the CPU contract)
  native:         "native" (torch's production ops)

`mode(impl="reference")` (or any implementation name) pins the strict implementation; a
pinned implementation that cannot run raises — there is no silent fallback. Provenance
records the contract id *and* the implementation that ran, so a strict run whose
implementation fell back to the composition is visible.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from .contracts.base import Contract, declared_arch, on_arch

__all__ = [
    "OPS",
    "BackendUnavailable",
    "ExecutionPolicy",
    "ProvenanceRecord",
    "mode",
    "current_policy",
    "register",
    "contract_for",
    "effective_contract",
    "resolve",
    "Implementation",
    "record_provenance",
    "ProvenanceCounter",
    "tap",
    "tapped",
    "note_kernel",
    "kernel_notes",
    "register_fusion",
    "fusion",
    "call_fusion",
]

# The op names the public API dispatches; recipes use the same names for
# per-op overrides (rlkernel.ops.<op>=strict|native).
OPS = ("rms_norm", "linear", "swiglu", "rope", "attention", "linear_logprob")
_CHOICES = ("strict", "native")


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run this op on this device (never a silent fallback)."""


@dataclass(frozen=True, slots=True)
class ExecutionPolicy:
    mode: str = "strict"  # "strict" or "native": the default for every op
    impl: str | None = None  # pinned strict implementation ("cpu", "reference", "triton"); None: by device
    ops: tuple = ()  # per-op overrides: ((op, "strict" | "native" | implementation name), ...)
    # Implementations may keep weights in a packed layout between calls, re-packing when a
    # weight's version counter moves. Only for callers whose weight updates are in-place tensor
    # ops (a write through `.data` does not move the counter): the engines turn it on.
    pack_weights: bool = False

    def __post_init__(self):
        if self.mode not in _CHOICES:
            raise ValueError(f"mode must be one of {_CHOICES}, got {self.mode!r}")
        ops = tuple(sorted(dict(self.ops).items())) if isinstance(self.ops, Mapping) else tuple(self.ops)
        for op, _ in ops:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r} in per-op overrides; known: {OPS}")
        object.__setattr__(self, "ops", ops)

    def choice(self, op: str) -> str:
        return dict(self.ops).get(op, self.mode)


_POLICY: contextvars.ContextVar[ExecutionPolicy] = contextvars.ContextVar("rlkernel_policy", default=ExecutionPolicy())


def current_policy() -> ExecutionPolicy:
    return _POLICY.get()


@contextlib.contextmanager
def mode(mode: str = "strict", *, impl: str | None = None, ops: Mapping[str, str] | None = None,
         pack_weights: bool | None = None) -> Iterator[ExecutionPolicy]:
    """Run the enclosed ops under a policy; nests and restores on exit or exception.
    `impl` pins the strict implementation; left out, an enclosing block's pin is kept
    (`impl="auto"` drops it); so is `pack_weights` (see ExecutionPolicy).

    >>> with rlkernel.mode("native", ops={"attention": "strict"}): ...
    >>> with rlkernel.mode(impl="reference"): ...   # the torch composition, same bits
    """
    outer = _POLICY.get()
    if impl is None:
        impl = outer.impl
    _check_names(impl, ops)
    policy = ExecutionPolicy(mode=mode, impl=None if impl == "auto" else impl, ops=tuple(sorted((ops or {}).items())),
                             pack_weights=outer.pack_weights if pack_weights is None else pack_weights)
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


def _check_names(impl: str | None, ops: Mapping[str, str] | None) -> None:
    """`mode`'s pin: `impl` names a strict implementation, so "native" (torch's ops) is refused at the block's entry —
    it would run native numerics under mode "strict". (An unknown name fails at the block's first op, naming the
    registered ones: BackendUnavailable, which golden.compute records per case.)"""
    if impl == "native":
        raise ValueError("mode: impl='native' is not a strict implementation (impl pins one: cpu, reference, triton, "
                         "...; for torch's own ops use mode='native')")


@dataclass(frozen=True, slots=True)
class Implementation:
    name: str  # "native", "reference", "cpu", "triton"
    fn: Callable  # the op's implementation, called with the public function's arguments
    contract: Contract  # the contract it implements (implementations of one contract agree bitwise)
    devices: tuple  # device types it runs on ("cpu", "cuda")
    available: Callable[[], bool]  # whether it can run in this process (built, self-checked)
    prims: object = None  # its primitives (backends.reference.primitives.Prims) for strict building blocks
    why: Callable[[], str | None] | None = None  # why it is not available here (None: no reason given)


_REGISTRY: dict[tuple[str, str], Implementation] = {}
# strict implementations in order of preference, by device type
_STRICT_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("triton", "reference")}


def strict_preference(device_type: str) -> tuple:
    """The strict implementations of a device type, most preferred first (read-only: a run whose
    provenance shows a later one than the first fell back, and `vime` marks that)."""
    return _STRICT_ORDER.get(device_type, ("reference",))


def first_strict(op: str, device_type: str) -> str:
    """The strict implementation `op` should run on a device type: the most preferred one registered for that op and
    device (whether or not it can load here). A run that shows another one fell back."""
    for name in strict_preference(device_type):
        impl = _REGISTRY.get((op, name))
        if impl is not None and device_type in impl.devices:
            return name
    return strict_preference(device_type)[0]


def _always() -> bool:
    return True


def register(op: str, impl: str, contract: Contract, devices=("cpu", "cuda"), available: Callable[[], bool] = _always, prims=None,
             why: Callable[[], str | None] | None = None):
    """Decorator: register `fn` as implementation `impl` of `op` under `contract`."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if contract.op != op:
        raise ValueError(f"contract of {contract.op!r} registered for {op!r}")

    def deco(fn):
        _REGISTRY[(op, impl)] = Implementation(impl, fn, contract, tuple(devices), available, prims, why)
        return fn

    return deco


def _choice(op: str, policy: ExecutionPolicy, explicit: str | None) -> str:
    if explicit is not None and not explicit:
        raise ValueError(f"{op}: backend='' names no implementation (None: the current policy's)")
    choice = explicit or policy.choice(op)
    if choice == "strict":
        per_op = policy.choice(op)
        if per_op not in _CHOICES:  # a per-op override naming an implementation ("fa3"): that op's strict one
            return per_op
        if policy.impl:
            return policy.impl
    return choice


def resolve(op: str, device: torch.device, backend: str | None = None) -> Implementation:
    """The implementation that will run `op` on `device` under the current policy (or under
    `backend`: "strict", "native" or an implementation name)."""
    choice = _choice(op, _POLICY.get(), backend)
    if choice == "strict":
        for name in _STRICT_ORDER.get(device.type, ("reference",)):
            impl = _REGISTRY.get((op, name))
            if impl is not None and device.type in impl.devices and impl.available():
                return impl
        raise BackendUnavailable(f"rlkernel: no strict implementation of {op!r} runs on {device.type}")
    impl = _REGISTRY.get((op, choice))
    if impl is None:
        known = sorted(b for (o, b) in _REGISTRY if o == op)
        raise BackendUnavailable(f"rlkernel: no {choice!r} implementation of {op!r} (registered: {known}); strict mode never falls back")
    if device.type not in impl.devices:
        raise BackendUnavailable(f"rlkernel: implementation {choice!r} of {op!r} does not run on {device.type}; strict mode never falls back")
    if not impl.available():
        reason = impl.why() if impl.why is not None else None
        raise BackendUnavailable(f"rlkernel: implementation {choice!r} of {op!r} is not available here"
                                 f"{f' ({reason})' if reason else ''}; strict mode never falls back")
    return impl


def contract_for(op: str, backend: str | None = None, device: str | torch.device = "cpu") -> Contract:
    """The contract the current policy (or `backend`) would run `op` under (on a GPU of another architecture than a
    GPU contract declares: `effective_contract`)."""
    device = torch.device(device)
    return effective_contract(resolve(op, device, backend).contract, device)


@dataclass(frozen=True, slots=True)
class ProvenanceRecord:
    op: str  # op name
    backend: str  # the contract family that ran ("strict", "native", ...)
    impl: str  # the implementation that ran ("cpu", "reference", "native", "triton")
    contract_id: str  # Contract.contract_id of that contract
    shapes: tuple  # shapes of the tensor arguments, in call order
    dtypes: tuple  # their dtypes, as strings
    device: str  # device type the call ran on
    threads: int  # torch.get_num_threads() at call time


_COLLECTOR: contextvars.ContextVar[tuple] = contextvars.ContextVar("rlkernel_provenance", default=())


@contextlib.contextmanager
def record_provenance() -> Iterator[list]:
    """Collect a ProvenanceRecord for every op call in the block (a run archives these per step).
    Collectors nest: a call is recorded in every enclosing collector."""
    records: list[ProvenanceRecord] = []
    token = _COLLECTOR.set(_COLLECTOR.get() + (records,))
    try:
        yield records
    finally:
        _COLLECTOR.reset(token)


_ARCH: dict = {}  # CUDA device index -> "sm_XY", asked once
_EFFECTIVE: dict = {}  # (contract id, CUDA device index) -> effective_contract


def _cuda_arch(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = _ARCH.get(index)
    if arch is None:  # (golden.gpu_arch's name; golden sits above this layer: tests/test_layout.py)
        major, minor = torch.cuda.get_device_capability(index)
        arch = _ARCH[index] = f"sm_{major}{minor}"
    return arch


def effective_contract(c: Contract, device: torch.device) -> Contract:
    """The contract a call on `device` ran under: `c`, or on a GPU of another architecture than `c` declares,
    `contracts.base.on_arch(c, that architecture)` (what provenance records)."""
    if device.type != "cuda" or declared_arch(c) is None or not torch.cuda.is_available():
        return c  # (a machine without a GPU predicting a GPU run: the declared contract)
    return on_arch(c, _cuda_arch(device))


def _record(op: str, impl: Implementation, tensors: tuple) -> None:
    collectors = _COLLECTOR.get()
    if not collectors:
        return
    c, device = impl.contract, tensors[0].device.type
    if device == "cuda":  # the contract on this GPU's architecture (one dict lookup a call)
        key = (c.contract_id, tensors[0].device.index)
        c = _EFFECTIVE.get(key) or _EFFECTIVE.setdefault(key, effective_contract(c, tensors[0].device))
    rec = None
    for sink in collectors:
        if isinstance(sink, dict):  # a ProvenanceCounter's counts: no per-call record is built
            key = (op, c.backend, impl.name, c.contract_id, device)
            sink[key] = sink.get(key, 0) + 1
            continue
        if rec is None:
            rec = ProvenanceRecord(
                op=op,
                backend=c.backend,
                impl=impl.name,
                contract_id=c.contract_id,
                shapes=tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)),
                dtypes=tuple(str(t.dtype) for t in tensors if isinstance(t, torch.Tensor)),
                device=device,
                threads=torch.get_num_threads(),
            )
        sink.append(rec)


def call(op: str, backend: str | None, tensors: tuple, *args, **kwargs):
    """Resolve `op` for the device of its first tensor, record provenance, run it. Its floating-point tensors (the data:
    x, weight, q / k / v, hidden) must share that device — an implementation reads them where the first one lives, and
    a pointer of another device is not memory there; index tensors (positions, targets) are the implementations' to
    place."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.is_floating_point() and t.device != device:
            raise ValueError(f"{op}: all tensor arguments must be on one device; the first is on {device}, another "
                             f"{tuple(t.shape)} on {t.device}")
    impl = resolve(op, device, backend)
    _record(op, impl, tensors)
    taps = _TAPS.get()
    if not taps:
        return impl.fn(*args, **kwargs)
    notes: list = []
    token = _NOTES.set(notes)
    try:
        out = impl.fn(*args, **kwargs)
    finally:
        _NOTES.reset(token)
    token = _OBSERVED.set(tuple(notes))
    try:
        for fn in taps:
            fn(op, impl, tensors, out)
    finally:
        _OBSERVED.reset(token)
    return out


_TAPS: contextvars.ContextVar[tuple] = contextvars.ContextVar("rlkernel_taps", default=())
_NOTES: contextvars.ContextVar[list | None] = contextvars.ContextVar("rlkernel_kernel_notes", default=None)
_OBSERVED: contextvars.ContextVar[tuple] = contextvars.ContextVar("rlkernel_observed_notes", default=())


def note_kernel(text) -> None:
    """A backend names the kernel it launched for this op call (a tile, a schedule, a Gluon kernel, a packed weight)
    — for a `tap` observing the call (`vime diagnose`: which kernels each engine ran where they differ); nothing when
    none observes. `text` may be a callable, called only then (no formatting on the hot path)."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(text() if callable(text) else text)


def kernel_notes() -> tuple:
    """Inside a tap's callback: the kernels the observed op call's implementation named (`note_kernel`), in order."""
    return _OBSERVED.get()


@contextlib.contextmanager
def tap(fn: Callable[[str, Implementation, tuple, object], None]) -> Iterator[None]:
    """Observe every dispatched op call in the block: `fn(op, implementation, input tensors, output)`
    runs after the op (read-only: for diagnosis, e.g. `vime diagnose`; values are not changed)."""
    token = _TAPS.set(_TAPS.get() + (fn,))
    try:
        yield
    finally:
        _TAPS.reset(token)


def tapped() -> bool:
    """Whether a `tap` observes this context (a fusion then runs its ops one by one, so the tap sees each)."""
    return bool(_TAPS.get())


_FUSIONS: dict[tuple, Callable] = {}


def register_fusion(ops: tuple, impls: tuple, fn: Callable) -> None:
    """Register `fn` as one launch for the chain `ops` (e.g. ("linear", "swiglu")) when implementations `impls` are the
    ones that would run them: it must give the chain's bits under their contracts (the backend's tests prove it)."""
    if len(ops) != len(impls) or any(op not in OPS for op in ops):
        raise ValueError(f"register_fusion: ops {ops} / implementations {impls}")
    _FUSIONS[(tuple(ops), tuple(impls))] = fn


def fusion(ops: tuple, impls: tuple[Implementation, ...]) -> Callable | None:
    """The fused function for `ops` run by `impls` (resolved), or None: no fusion registered, or a tap observes
    (`tapped`)."""
    if tapped():
        return None
    return _FUSIONS.get((tuple(ops), tuple(i.name for i in impls)))


def call_fusion(ops: tuple, backend: str | None, op_tensors: tuple, *args):
    """Run the chain `ops` as its registered fusion under the current policy (or `backend`), if there is one and no
    gradient is wanted of any input: each op's call recorded in provenance as `call` records it (`op_tensors`: each
    op's input tensors), the fusion's output returned. None: no fusion applies (none registered, a tap observes, a
    gradient is wanted) and the caller runs the ops one by one."""
    device = op_tensors[0][0].device
    impls = tuple(resolve(op, device, backend) for op in ops)
    fn = fusion(ops, impls)
    if fn is None or (torch.is_grad_enabled() and any(t.requires_grad for ts in op_tensors for t in ts)):
        return None
    for op, impl, ts in zip(ops, impls, op_tensors):
        _record(op, impl, ts)
    return fn(*args)


def note_call(op: str, impl: Implementation, tensors: tuple) -> None:
    """Record a call that a building block makes outside `call` (e.g. the partial GEMMs of a
    row-parallel layer), so provenance still shows which contract and implementation ran."""
    _record(op, impl, tensors)

class ProvenanceCounter:
    """Aggregates ProvenanceRecords into per-op call counts by (backend, contract id): what an
    engine archives per step without keeping every call."""

    def __init__(self):
        self.counts: dict[tuple[str, str, str, str, str], int] = {}

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        token = _COLLECTOR.set(_COLLECTOR.get() + (self.counts,))
        try:
            yield
        finally:
            _COLLECTOR.reset(token)

    def take(self) -> dict[str, list[dict]]:
        """{op: [{backend, impl, contract_id, device, calls}, ...]} since the last take; resets."""
        out: dict[str, list[dict]] = {}
        for (op, backend, impl, cid, device), n in sorted(self.counts.items()):
            out.setdefault(op, []).append({"backend": backend, "impl": impl, "contract_id": cid, "device": device, "calls": n})
        self.counts.clear()
        return out


def contracts_match(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> tuple[bool, list[str]]:
    """Whether every op both summaries used ran under the same contract ids; the ops that did not."""
    differ = [op for op in sorted(set(a) & set(b))
              if {e["contract_id"] for e in a[op]} != {e["contract_id"] for e in b[op]}]
    return not differ, differ
