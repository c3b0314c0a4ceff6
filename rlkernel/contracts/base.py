"""Numerical contracts: what an op's result is allowed to depend on, as data.

What this module decides: the fields a contract has and how two contracts are
compared. Fields follow the write-up's tuple — reduction domain D, partition Π,
merge tree T, precision P, rounding points R, primitives A. Two execution paths
whose contracts differ in any field are predicted to disagree in the last bits;
`diff` says in which field, before anything runs.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields

__all__ = ["Contract", "FieldDiff", "diff", "declared_arch", "on_arch"]


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Contract:
    op: str  # op name, as in rlkernel's public API ("linear", "attention", ...)
    backend: str  # the contract family: "strict" (CPU kernels and the reference composition), "native", "triton-sm90", ...
    domain: str  # D: what is reduced ("K", "hidden", "visible keys", "vocab", "ranks")
    partition: tuple = ()  # Π: (name, value) pairs, e.g. (("m_tile", 16), ("split_k", 1))
    merge: str = ""  # T: the order partial results are combined in
    precision: tuple = ()  # P: (name, dtype) pairs: inputs, accumulator, partials, output
    rounding: tuple = ()  # R: the points where a value is rounded to a narrower dtype
    primitives: tuple = ()  # A: (name, formula) pairs for exp/log/rsqrt/SiLU ...
    invariant: tuple = ()  # invariances this backend claims (proved by tests)
    version: int = 1  # bumped whenever the numerics change
    _id: str = field(default="", init=False, repr=False, compare=False)  # contract_id, computed once

    def __post_init__(self):
        for name in ("partition", "precision", "rounding", "primitives", "invariant"):
            object.__setattr__(self, name, _freeze(getattr(self, name)))
        if not self.op or not self.backend:
            raise ValueError("a Contract needs an op and a backend")
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str)
        object.__setattr__(self, "_id", f"{self.op}/{self.backend}/v{self.version}/" + hashlib.sha256(blob.encode()).hexdigest()[:12])

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_id"}

    @property
    def contract_id(self) -> str:
        """Stable short hash of every field: equal ids, equal numerics (computed once: every op
        call records it)."""
        return self._id


@dataclass(frozen=True, slots=True)
class FieldDiff:
    field: str  # the contract field that differs ("partition", "merge", ...)
    left: object  # its value in the first contract
    right: object  # its value in the second

    def __str__(self) -> str:
        return f"{self.field}: {self.left!r} != {self.right!r}"


_NUMERIC_FIELDS = ("domain", "partition", "merge", "precision", "rounding", "primitives", "version")


def diff(a: Contract, b: Contract) -> list[FieldDiff]:
    """ΔC: the numeric fields in which two contracts of one op differ.

    An empty list predicts bitwise agreement between the two paths; the
    backend name itself is not numeric and is not compared.
    """
    if a.op != b.op:
        raise ValueError(f"cannot diff contracts of different ops: {a.op!r} vs {b.op!r}")
    return [FieldDiff(n, getattr(a, n), getattr(b, n)) for n in _NUMERIC_FIELDS if getattr(a, n) != getattr(b, n)]


def declared_arch(c: Contract) -> str | None:
    """The GPU architecture a contract is declared (and its golden bits recorded) for: its partition's "arch"
    ("sm_90"); None for a contract that names none (the CPU contracts)."""
    return dict(c.partition).get("arch")


_ON_ARCH: dict[tuple[str, str], Contract] = {}


def on_arch(c: Contract, arch: str) -> Contract:
    """The contract a call of `c`'s implementation runs under on a GPU of architecture `arch` ("sm_80"): `c` itself
    where it declares `arch` or no architecture; else `c` with that architecture in its partition and its family's
    name (another contract id, a ΔC in `partition`): the same kernels lower to another instruction chain there (sm_80:
    mma.sync, sm_100: tcgen05, against sm_90's wgmma k16 chain), whose bits nothing here has proved — so an sm_90
    rollout and an sm_80 trainer are told apart (`contracts_match`) instead of both claiming sm_90."""
    have = declared_arch(c)
    if have is None or have == arch:
        return c
    key = (c.contract_id, arch)
    out = _ON_ARCH.get(key)
    if out is None:
        import dataclasses

        tag, new = have.replace("_", ""), arch.replace("_", "")  # "sm90" in family names ("triton-sm90")
        part = tuple((k, arch) if k == "arch" else (k, v) for k, v in c.partition)
        out = _ON_ARCH[key] = dataclasses.replace(c, partition=part, backend=c.backend.replace(tag, new)
                                                  if tag in c.backend else f"{c.backend}@{new}")
    return out
