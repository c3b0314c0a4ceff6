"""Rewards in a child process: a per-sample timeout, and every failure counted by reason.

What this module decides: how the rollout role calls the reward function and what a
failure becomes. The function runs in its own Python process (`python -m
vime.data.reward_worker FN`), one sample at a time over pipes (JSON lines), so a reward
that hangs is killed after `timeout_s` (and the process restarted for the next sample)
instead of hanging the run, and one that raises or crashes cannot take the rollout
engine down. Every sample gets a status:

  "ok"                      the function returned a finite number (bools count as 0/1)
  "timeout"                 no answer within timeout_s; the worker was killed
  "raised:<ExceptionType>"  the function raised
  "not_a_number"            it returned something else (None, a string, NaN, inf)
  "worker_died"             the process exited mid-sample (os._exit, a segfault)

A failed sample's reward is 0.0 — the loop needs a number for the group's advantage — and
its status stays on its record (`TokenRecord.reward_status`) and is counted per reason in
the step's metrics (`reward_failures`), so a failing reward is never a silent 0.

Model output is hostile input here: the process's address space is capped (`RLIMIT_AS`,
`reward.memory_mb`; a reward that tries to build a huge number or expression gets a
MemoryError, counted as "raised:MemoryError", instead of taking the machine's memory), it
writes no core files, and the wall-clock timeout bounds what the cap does not (CPU time in
C code that never returns to Python, e.g. sympy/gmpy arithmetic on 9^9^9^9). The text
travels as a JSON string and is passed to the function as a `str`; nothing here evaluates it.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import resource
import select
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass

REWARD_FNS = {"math_verify": "vime.data.rewards:math_reward"}  # reward.fn names -> "module:function"


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardResult:
    value: float  # the reward used for advantages (0.0 when status != "ok")
    status: str  # "ok" | "timeout" | "raised:<ExceptionType>" | "not_a_number" | "worker_died"


def resolve(fn: str):
    module, _, attr = REWARD_FNS.get(fn, fn).partition(":")
    return getattr(importlib.import_module(module), attr)


def _result(msg: dict) -> RewardResult:
    if "raised" in msg:
        return RewardResult(value=0.0, status=f"raised:{msg['raised']}")
    v = msg.get("value")
    if isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
        return RewardResult(value=float(v), status="ok")
    return RewardResult(value=0.0, status="not_a_number")


def _why(msg: dict) -> str:
    """What a failed sample's reply says, for the console: the exception and its last frames, or what came back."""
    if "raised" in msg:
        return f"raised {msg['raised']}: {msg.get('message', '')}\n{msg.get('trace', '')}".rstrip()
    return f"returned {msg.get('returned') or type(msg.get('value')).__name__} {msg.get('value')!r}, not a finite number"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class RewardWorker:
    """`score([(response_text, ground_truth), ...])` -> RewardResults, one child process at a time."""

    def __init__(self, fn: str, timeout_s: float, startup_s: float = 120.0, memory_mb: int = 4096):
        self.fn, self.timeout_s, self.startup_s = REWARD_FNS.get(fn, fn), float(timeout_s), float(startup_s)
        self.memory_mb = int(memory_mb)
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._finalizer = None
        self._said: set[str] = set()  # the failure kinds already shown on the console

    def _start(self) -> None:
        # the child imports what this process can (tests' modules, a user's package on sys.path)
        env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "vime.data.reward_worker", self.fn, str(self.memory_mb)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._buf = b""
        try:
            msg = self._read(self.startup_s)
        except EOFError:
            msg = None
        if not msg or "ready" not in msg:
            self._stop()
            raise RuntimeError(f"reward.fn {self.fn!r}: the reward worker did not start ({msg or 'no answer'}); "
                               "check that the module imports and the function exists")

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the process
        self._proc, self._finalizer = None, None

    def _read(self, timeout: float) -> dict | None:
        """The next JSON line from the worker; None after `timeout` seconds; EOFError if it exited."""
        deadline, fd = time.monotonic() + timeout, self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def score(self, pairs) -> list[RewardResult]:
        out = []
        for text, truth in pairs:
            if self._proc is None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps({"text": text, "truth": truth}) + "\n").encode())
                self._proc.stdin.flush()
                msg = self._read(self.timeout_s)
            except (BrokenPipeError, EOFError):
                self._stop()
                out.append(RewardResult(value=0.0, status="worker_died"))
                continue
            if msg is None:
                self._stop()
                out.append(RewardResult(value=0.0, status="timeout"))
                continue
            res = _result(msg)
            if res.status != "ok" and res.status not in self._said:  # the first of each kind, with its cause
                self._said.add(res.status)
                print(f"vime: reward.fn {self.fn} failed on a sample ({res.status}; it gets reward 0, counted in the "
                      f"step's reward_failures; later ones of this kind are counted only): {_why(msg)}", file=sys.stderr)
            out.append(res)
        return out

    def close(self) -> None:
        self._stop()


def _limit(memory_mb: int) -> None:
    """Cap this process's address space and turn off core files, before any reward code is imported."""
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _serve(fn_path: str, memory_mb: int) -> int:
    _limit(memory_mb)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the reward function prints goes to stderr, not into the protocol
    try:
        fn = resolve(fn_path)
    except Exception as e:  # noqa: BLE001 — reported to the parent, which raises with it
        proto.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            value = fn(req["text"], req["truth"])
            if not isinstance(value, (bool, int, float)) and type(value).__module__.split(".")[0] in ("numpy", "torch"):
                try:  # a numpy / torch scalar (np.float32, a 0-d tensor) is a number: its Python value
                    value = value.item()
                except (ValueError, RuntimeError, AttributeError):
                    pass
            reply = {"value": value}
        except Exception as e:  # noqa: BLE001 — counted by type in the parent, which shows the first of each type
            reply = {"raised": type(e).__name__, "message": str(e)[:500],
                     "trace": "".join(traceback.format_exception(e)[-4:])[-2000:]}
        try:
            text = json.dumps(reply)
        except (TypeError, ValueError):  # not JSON: certainly not a number
            text = json.dumps({"value": None, "returned": type(reply.get("value")).__name__})
        proto.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096))
