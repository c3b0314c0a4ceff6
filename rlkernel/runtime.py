"""Process-level settings the strict CPU path wants, applied explicitly and recorded.

What this module decides: the allocator behaviour of CPU processes that run the
reference backend. Its ops allocate many short-lived tensors of 100 KB-10 MB;
glibc serves each from a fresh mmap and returns it on free, so every op pays
page faults (measured here: a 147K-element fill 90 us instead of 10 us). Raising
glibc's mmap and trim thresholds keeps those blocks on the heap. This changes
no value any op computes — only time — and is done by the engines that need it
(never at import), with the setting recorded in their provenance.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_applied: dict | None = None


def tune_cpu_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> dict:
    """Raise glibc malloc thresholds once per process; returns what was applied (for provenance)."""
    global _applied
    if _applied is not None:
        return _applied
    result = {"allocator": "unchanged", "reason": ""}
    if platform.system() != "Linux":
        result["reason"] = "not Linux"
    else:
        path = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(path)
            ok = all(libc.mallopt(k, v) == 1 for k, v in ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad)))
            result = {"allocator": "glibc mallopt" if ok else "mallopt refused", "mmap_threshold": mmap_threshold,
                      "trim_threshold": trim_threshold, "top_pad": top_pad}
        except (OSError, AttributeError) as e:
            result["reason"] = f"no glibc mallopt: {e}"
    _applied = result
    return result
