"""Claims (issue 12, item 7):
1. Ray, started by vime, listens on loopback only: the node address, the GCS address and every
   node's manager address Ray reports are 127.0.0.1, every socket its processes (GCS, raylet,
   agents, workers, an actor) bind is on loopback, the dashboard has no URL, and Ray's token
   authentication is on. Negative control: Ray imported before vime could configure it rewrites
   `_node_ip_address="127.0.0.1"` to the node's routable address — and vime refuses to run on it.
   (The whole-run check — vLLM, Megatron's gloo, the reward worker, wandb — is in test_e2e_loop.)
2. Nothing is unpickled from disk: no `pickle`/`torch.load` without `weights_only=True` /
   `allow_pickle=True` in the code (checkpoints are safetensors + JSON; test_e2e_loop checks a
   run's checkpoints hold no pickle file).
3. The CPU kernel cache is verified before it is loaded: a library replaced by another one is
   deleted and relinked, never loaded (negative control: loading that library does run its code);
   a cache directory writable by others is refused, and the composition serves the strict ops.
4. Reward code never evaluates model output and is bounded: hostile strings (power towers,
   deep nesting, factorials of huge numbers, `__import__` payloads, TeX macro bombs) each get a
   counted status, no payload runs, and the worker then scores a normal sample; an allocation
   beyond `reward.memory_mb` is a counted MemoryError (negative control: without the cap it succeeds).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import last_json
from vime.data.reward_worker import RewardWorker

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter from the repository root (the working tree's packages)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | (env or {}))


_RAY = """
    import json, psutil  # no `import ray` before vime.executor: that is test_ray_imported_first_is_refused
    from vime.executor import RayExecutor, ray_addresses

    class Ping:
        def ping(self):
            return "pong"

    ex = RayExecutor(num_roles=1)
    actor = ex.spawn(Ping)
    assert actor.call("ping") == "pong"
    from ray._raylet import AuthenticationMode, get_authentication_mode
    bound = set()
    root = psutil.Process()
    for p in [root, *root.children(recursive=True)]:
        try:
            bound |= {(p.name(), c.laddr.ip) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN or not c.raddr}
        except psutil.NoSuchProcess:
            pass
    print(json.dumps({"addresses": ray_addresses(), "bound": sorted(bound), "token_auth": get_authentication_mode() == AuthenticationMode.TOKEN}))
    ex.shutdown()
"""


def test_ray_listens_on_loopback_only():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # nothing pre-set by the caller
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_RAY)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from vime.executor import is_loopback

    got = last_json(proc.stdout)
    a = got["addresses"]
    assert a["node_ip_address"] == "127.0.0.1" and a["gcs_address"].startswith("127.0.0.1:") and a["nodes"] == "127.0.0.1", a
    assert a["dashboard_url"] == ""
    names = {n for n, _ in got["bound"]}
    assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), names
    assert [b for b in got["bound"] if not is_loopback(b[1])] == []
    assert got["token_auth"]


def test_ray_imported_first_is_refused():
    """Negative control: Ray imported (its constants read) before vime sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    code = "import json, ray\nfrom vime.executor import RayExecutor, NotLoopbackError, ray_addresses\ntry:\n" \
           "    ex = RayExecutor(num_roles=1)\nexcept NotLoopbackError as e:\n    print('REFUSED', e)\nelse:\n" \
           "    print('RAN', json.dumps(ray_addresses()))\n    ex.shutdown()\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    routable = [n for _, n in socket.if_nameindex() if not n.startswith("lo")]
    ran = re.search(r"^RAN (\{.*\})$", proc.stdout, re.M)
    if ran:  # nothing refused: then Ray must really be on loopback only (it found no routable
        from helpers import record_native  # address to rewrite to on this machine), else the exposure check failed
        from vime.executor import is_loopback

        a = json.loads(ran.group(1))
        assert a["dashboard_url"] == "" and all(is_loopback(x) for k in ("node_ip_address", "gcs_address", "nodes")
                                                for x in a[k].split(",")), a
        record_native(f"Ray's loopback rewrite (interfaces {routable})", 0)
        return
    assert re.search(r"REFUSED Ray is not on loopback only: \{'node_ip_address': '(?!127\.)[\d.]+'", proc.stdout), proc.stdout


def test_nothing_is_unpickled_from_disk():
    bad = re.compile(r"\bpickle\.loads?\(|\bcloudpickle\.loads?\(|\bdill\.loads?\(|\bjoblib\.load\(|allow_pickle\s*=\s*True|"
                     r"torch\.load\((?!.*weights_only\s*=\s*True)")
    hits = []
    for folder in ("vime", "rlkernel", "scripts", "tests"):
        for f in (ROOT / folder).rglob("*.py"):
            if f.name == Path(__file__).name:
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if bad.search(line):
                    hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []


# ---------------------------------------------------------------------------- kernel cache
_EVIL = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void run_on_load(void) {
    FILE *f = fopen(getenv("EVIL_MARKER"), "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
"""


@pytest.fixture
def cache_copy(tmp_path):
    """A copy of this machine's verified kernel cache under tmp_path (RLKERNEL_BUILD_DIR)."""
    from rlkernel.backends import cpu
    from rlkernel.backends.cpu import build

    assert cpu.available(), cpu.status()
    src = build.build_dir()
    dst = tmp_path / "cache" / src.name
    shutil.copytree(src, dst, symlinks=False)
    return dst, dst / f"rlkernel_strict_cpu_{build.key()}.so"


_STATUS = "import json\nfrom rlkernel.backends import cpu\nprint(json.dumps(cpu.status()))"


def test_tampered_kernel_library_is_rebuilt_never_loaded(tmp_path, cache_copy):
    from rlkernel.backends.cpu.build import MANIFEST

    d, lib = cache_copy
    good = json.loads((d / MANIFEST).read_text())["files"][lib.name]
    (tmp_path / "evil.c").write_text(_EVIL)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "evil.so"), str(tmp_path / "evil.c")], check=True)
    marker = tmp_path / "marker"
    env = {"RLKERNEL_BUILD_DIR": str(d.parent), "EVIL_MARKER": str(marker)}
    # negative control: this library runs code the moment it is loaded
    proc = _python(f"import torch\ntorch.ops.load_library({str(tmp_path / 'evil.so')!r})", env)
    assert proc.returncode == 0 and marker.read_text() == "loaded", proc.stderr
    marker.unlink()
    shutil.copy(tmp_path / "evil.so", lib)
    proc = _python(_STATUS, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists(), "the tampered library was loaded"
    assert f"{lib.name} not as built" in proc.stderr
    status = last_json(proc.stdout)
    assert status["cpu_kernels"] and status["library"] == str(lib) and status["self_check"]
    from rlkernel.backends.cpu.build import _sha256

    rebuilt = _sha256(lib)
    assert rebuilt != _sha256(tmp_path / "evil.so")  # the tampered bytes are gone
    # and the manifest now vouches for the library that was rebuilt (whether the linker reproduces the old bytes
    # exactly depends on whether ninja relinks or recompiles in the copied directory, so `good` is not required)
    assert json.loads((d / MANIFEST).read_text())["files"][lib.name] == rebuilt
    print("rebuilt library equals the original bytes:", rebuilt == good)


def test_kernel_cache_writable_by_others_is_refused(cache_copy):
    d, lib = cache_copy
    d.chmod(0o777)
    proc = _python(_STATUS, {"RLKERNEL_BUILD_DIR": str(d.parent)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = last_json(proc.stdout)
    assert not status["cpu_kernels"] and "writable by group or others" in status["error"], status
    assert "the reference composition serves the strict ops" in proc.stderr


# ---------------------------------------------------------------------------- rewards
def _hostile(marker: Path) -> list[str]:
    payload = f"__import__('os').system('touch {marker}')"
    return [
        "Answer: 9^9^9^9",
        "Answer: (9^9)^(9^9)^(9^9)",  # sympy's comparison of a power tower: runs past the timeout
        "Answer: " + "(" * 5000 + "1" + ")" * 5000,  # nesting deeper than the parser's patience
        "Answer: (10^100)!",
        "Answer: " + "\\frac{" * 200 + "1" + "}{2}" * 200,
        f"Answer: {payload}",
        f"Answer: \\boxed{{{payload}}}",
        f"Answer: ${payload}$",
        "Answer: \\def\\a{\\a\\a}\\a",
        "Answer: " + "9" * 100_000,
    ]


def test_hostile_model_output_is_bounded_and_counted(tmp_path):
    marker = tmp_path / "payload_ran"
    worker = RewardWorker("math_verify", timeout_s=2.0, memory_mb=1024)
    try:
        t0 = time.monotonic()
        res = worker.score([(h, "7") for h in _hostile(marker)] + [("Answer: 7", "7")])
        took = time.monotonic() - t0
    finally:
        worker.close()
    statuses = [r.status for r in res[:-1]]
    assert set(statuses) <= {"ok", "timeout", "raised:MemoryError"} and all(r.value == 0.0 for r in res[:-1]), statuses
    assert statuses.count("timeout") >= 1  # some really needed the process boundary
    assert (res[-1].value, res[-1].status) == (1.0, "ok")  # the worker came back for the next sample
    assert not marker.exists()
    assert took < 90


def test_reward_memory_is_capped():
    capped = RewardWorker("faulty_rewards:by_text", timeout_s=30.0, memory_mb=512)
    free = RewardWorker("faulty_rewards:by_text", timeout_s=30.0, memory_mb=64 << 10)  # negative control: a cap above the request
    try:
        assert [(r.value, r.status) for r in capped.score([("alloc", "7"), ("7", "7")])] == [(0.0, "raised:MemoryError"), (1.0, "ok")]
        assert [(r.value, r.status) for r in free.score([("alloc", "7")])] == [(float(8 << 30), "ok")]
    finally:
        capped.close()
        free.close()
