"""Backend selection, the op registry and provenance.

What this module decides: which implementation runs each op call, and what is
recorded about it. Selection is explicit and scoped: `rlkernel.mode(...)` is a
context manager over a `contextvars.ContextVar`, so it nests, it is restored on
any exception, and threads/async tasks do not leak into each other. With no mode
set, every op runs strict on the device's default strict backend. In strict
mode an unavailable backend raises — there is no silent fallback.

Backends register per op (`register`); a Triton backend adds itself the same
way, which is the seam for the GPU issue.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch

from .contract import Contract

__all__ = [
    "OPS",
    "BackendUnavailable",
    "ExecutionPolicy",
    "ProvenanceRecord",
    "mode",
    "current_policy",
    "register",
    "contract_for",
    "resolve",
    "record_provenance",
    "ProvenanceCounter",
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
    backend: str | None = None  # strict backend override ("reference", "triton"); None: device default
    ops: tuple = ()  # per-op overrides: ((op, "strict" | "native" | backend name), ...)

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
def mode(mode: str = "strict", *, backend: str | None = None, ops: Mapping[str, str] | None = None) -> Iterator[ExecutionPolicy]:
    """Run the enclosed ops under a policy; nests and restores on exit or exception.

    >>> with rlkernel.mode("native", ops={"attention": "strict"}): ...
    """
    policy = ExecutionPolicy(mode=mode, backend=backend, ops=tuple(sorted((ops or {}).items())))
    token = _POLICY.set(policy)
    try:
        yield policy
    finally:
        _POLICY.reset(token)


@dataclass(frozen=True, slots=True)
class _Impl:
    fn: Callable
    contract: Contract
    devices: tuple  # device types it runs on ("cpu", "cuda")


_REGISTRY: dict[tuple[str, str], _Impl] = {}


def register(op: str, backend: str, contract: Contract, devices=("cpu", "cuda")):
    """Decorator: register `fn` as `backend`'s implementation of `op`."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if contract.op != op or contract.backend != backend:
        raise ValueError(f"contract {contract.op}/{contract.backend} registered as {op}/{backend}")

    def deco(fn):
        _REGISTRY[(op, backend)] = _Impl(fn, contract, tuple(devices))
        return fn

    return deco


def default_strict_backend(device: torch.device) -> str:
    """The strict backend used when none is named: triton on GPUs once it is registered, else reference."""
    if device.type == "cuda" and any(b == "triton" for (_, b) in _REGISTRY):
        return "triton"
    return "reference"


def _backend_name(op: str, device: torch.device, policy: ExecutionPolicy, explicit: str | None) -> str:
    choice = explicit or policy.choice(op)
    if choice == "native":
        return "native"
    if choice == "strict":
        return policy.backend or default_strict_backend(device)
    return choice


def resolve(op: str, device: torch.device, backend: str | None = None) -> _Impl:
    """The implementation that will run `op` on `device` under the current policy."""
    policy = _POLICY.get()
    name = _backend_name(op, device, policy, backend)
    impl = _REGISTRY.get((op, name))
    if impl is None:
        known = sorted(b for (o, b) in _REGISTRY if o == op)
        raise BackendUnavailable(f"rlkernel: no {name!r} backend for {op!r} (registered: {known}); strict mode never falls back")
    if device.type not in impl.devices:
        raise BackendUnavailable(f"rlkernel: backend {name!r} of {op!r} does not run on {device.type}; strict mode never falls back")
    return impl


def contract_for(op: str, backend: str | None = None, device: str | torch.device = "cpu") -> Contract:
    """The contract the current policy (or `backend`) would run `op` under."""
    return resolve(op, torch.device(device), backend).contract


@dataclass(frozen=True, slots=True)
class ProvenanceRecord:
    op: str  # op name
    backend: str  # backend that ran
    contract_id: str  # Contract.contract_id of that backend's contract
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


def _record(op: str, impl: _Impl, tensors: tuple) -> None:
    collectors = _COLLECTOR.get()
    if not collectors:
        return
    c, device = impl.contract, tensors[0].device.type
    rec = None
    for sink in collectors:
        if isinstance(sink, dict):  # a ProvenanceCounter's counts: no per-call record is built
            key = (op, c.backend, c.contract_id, device)
            sink[key] = sink.get(key, 0) + 1
            continue
        if rec is None:
            rec = ProvenanceRecord(
                op=op,
                backend=c.backend,
                contract_id=c.contract_id,
                shapes=tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)),
                dtypes=tuple(str(t.dtype) for t in tensors if isinstance(t, torch.Tensor)),
                device=device,
                threads=torch.get_num_threads(),
            )
        sink.append(rec)


def call(op: str, backend: str | None, tensors: tuple, *args, **kwargs):
    """Resolve `op` for the device of its first tensor, record provenance, run it."""
    impl = resolve(op, tensors[0].device, backend)
    _record(op, impl, tensors)
    return impl.fn(*args, **kwargs)


def note_call(op: str, backend: str, tensors: tuple) -> None:
    """Record a call that a backend's building block makes outside `call` (e.g. the partial
    GEMMs of a row-parallel layer), so provenance still shows which contract ran."""
    _record(op, resolve(op, tensors[0].device, backend), tensors)

class ProvenanceCounter:
    """Aggregates ProvenanceRecords into per-op call counts by (backend, contract id): what an
    engine archives per step without keeping every call."""

    def __init__(self):
        self.counts: dict[tuple[str, str, str, str], int] = {}

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        token = _COLLECTOR.set(_COLLECTOR.get() + (self.counts,))
        try:
            yield
        finally:
            _COLLECTOR.reset(token)

    def take(self) -> dict[str, list[dict]]:
        """{op: [{backend, contract_id, device, calls}, ...]} since the last take; resets."""
        out: dict[str, list[dict]] = {}
        for (op, backend, cid, device), n in sorted(self.counts.items()):
            out.setdefault(op, []).append({"backend": backend, "contract_id": cid, "device": device, "calls": n})
        self.counts.clear()
        return out


def contracts_match(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> tuple[bool, list[str]]:
    """Whether every op both summaries used ran under the same contract ids; the ops that did not."""
    differ = [op for op in sorted(set(a) & set(b))
              if {e["contract_id"] for e in a[op]} != {e["contract_id"] for e in b[op]}]
    return not differ, differ
