"""What one timed piece of work cost besides its wall time: a probe for benchmarks whose figure moves between rounds.

    with RoundProbe() as probe:
        generate(...)
    probe.report(tokens=n)   # {"cpu_seconds", "cpu_ms_per_1k_tokens", "host_busy", "gc", "gpu"}

Why (H200 session 19): 20 paired rollout rounds put the strict engine at ~10k tokens/s in runs of 2-4 rounds and at
12.6-15.4k in the others while stock vLLM had no such modes. Per round this records what would tell the causes apart:
- cpu_seconds: user + system CPU time of this process and every live descendant (a vLLM engine's core process does its
  scheduling and model-runner host work there) — more CPU per token in the slow rounds: a host path grew;
- host_busy: the fraction of the whole host's CPU time that was busy (/proc/stat) — other work on the host;
- gc: this process's Python garbage collections in the round (count, seconds, and of the oldest generation);
- gpu: the first GPU's SM clock, power and utilisation sampled every 100 ms by `nvidia-smi` (mean and min) — a
  throttled or shared GPU; {"absent": why} where there is no nvidia-smi (CPU machines).
Descendants that exit during the round take their CPU time with them (psutil reads live processes only).
"""
from __future__ import annotations

import gc
import shutil
import subprocess
import time

SMI_FIELDS = ("clocks.sm", "power.draw", "utilization.gpu")


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += t.user + t.system
    return total


def host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host from /proc/stat's first line (idle and iowait count as not busy)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return sum(vals) - idle, sum(vals)


def parse_smi(text: str) -> dict:
    """nvidia-smi --format=csv,noheader,nounits lines of SMI_FIELDS -> mean and min of each field (unparseable values,
    e.g. "[N/A]", skipped); {"samples": 0} when none parsed."""
    cols: dict[str, list[float]] = {k: [] for k in SMI_FIELDS}
    n = 0
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(SMI_FIELDS):
            continue
        n += 1
        for k, v in zip(SMI_FIELDS, parts):
            try:
                cols[k].append(float(v))
            except ValueError:
                pass
    out: dict = {"samples": n}
    for k, vs in cols.items():
        if vs:
            out[k] = {"mean": round(sum(vs) / len(vs), 1), "min": round(min(vs), 1)}
    return out


class RoundProbe:
    """Context manager: CPU, host, GC and GPU-clock figures over its body (module docstring)."""

    def __init__(self, gpu: bool = True, smi_interval_ms: int = 100):
        self.gpu = gpu
        self.interval = smi_interval_ms

    def _gc_cb(self, phase, info):
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self.gc_seconds += time.perf_counter() - self._gc_t
            self.gc_count += 1
            self.gc_oldest += info.get("generation") == 2
            self._gc_t = None

    def __enter__(self):
        self.gc_seconds, self.gc_count, self.gc_oldest, self._gc_t = 0.0, 0, 0, None
        gc.callbacks.append(self._gc_cb)
        self.smi, self.smi_absent = None, None
        if self.gpu:
            exe = shutil.which("nvidia-smi")
            if exe is None:
                self.smi_absent = "nvidia-smi not found"
            else:
                self.smi = subprocess.Popen([exe, "-i", "0", f"--query-gpu={','.join(SMI_FIELDS)}",
                                             "--format=csv,noheader,nounits", f"-lms={self.interval}"],
                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.host0 = host_jiffies()
        self.cpu0 = tree_cpu_seconds()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = tree_cpu_seconds() - self.cpu0
        busy1, total1 = host_jiffies()
        dt = total1 - self.host0[1]
        self.host_busy = (busy1 - self.host0[0]) / dt if dt > 0 else None
        gc.callbacks.remove(self._gc_cb)
        self.gpu_rec = {"absent": self.smi_absent} if self.smi_absent else None
        if self.smi is not None:
            self.smi.terminate()
            try:
                text, _ = self.smi.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                self.smi.kill()
                text, _ = self.smi.communicate()
            self.gpu_rec = parse_smi(text)
        return False

    def report(self, tokens: int | None = None) -> dict:
        rep = {"wall_seconds": round(self.wall, 4), "cpu_seconds": round(self.cpu, 4),
               "host_busy": None if self.host_busy is None else round(self.host_busy, 4),
               "gc": {"collections": self.gc_count, "oldest": self.gc_oldest, "seconds": round(self.gc_seconds, 4)}}
        if tokens:
            rep["cpu_ms_per_1k_tokens"] = round(1e6 * self.cpu / tokens, 2)
        if self.gpu_rec is not None:
            rep["gpu"] = self.gpu_rec
        return rep
