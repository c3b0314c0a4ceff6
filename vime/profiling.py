"""One call under torch.profiler, summarised: where a GRPO update's host and device time go, and how often the host
waits for the device (`scripts/gpu_update_profile.py` outside the loop; `trainer.profile_update=N` inside it)."""
from __future__ import annotations

import time
from typing import Callable

import torch

_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profiled(fn: Callable, device: str, top: int = 25):
    """(fn(), summary): wall time, device-kernel count and time, kernel-launch calls, the host's waits for the device
    (synchronize calls) and host-device copies, and the top ops by host and by device time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.events()
    dev = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages()

    def rows(key):
        out = []
        for e in sorted(table, key=lambda e: getattr(e, key, 0), reverse=True)[:top]:
            out.append({"name": e.key[:120], "count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                        "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3)})
        return out

    summary = {"wall_seconds": round(wall, 4), "device_kernels": len(dev),
               "device_kernel_ms": round(sum(e.time_range.elapsed_us() for e in dev) / 1e3, 3),  # each kernel's own span
               "launch_calls": sum(1 for e in events if "LaunchKernel" in e.name),
               "host_waits": sum(1 for e in events if e.name in _WAITS),
               "memcpy_calls": sum(1 for e in events if e.name.startswith("cudaMemcpy")),
               "top_by_host": rows("self_cpu_time_total"), "top_by_device": rows("self_device_time_total") if cuda else []}
    return result, summary
