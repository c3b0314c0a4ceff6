"""Executors: where roles run. Ray actors in one placement group, or this process.

What this module decides: placement, the calling convention, how long the driver waits and
what the run listens on. The driver holds only handles; `handle.call(method, ...)` returns the
result, `handle.async_call(method, ...)` returns a future/ref (Ray) that `handle.wait` turns
into the result. Every wait on a remote call has a limit (`run.call_timeout_s`): a call that
does not return in time raises `RoleTimeoutError` naming the role, the method and the key,
and an actor that died raises `RoleDiedError` — never a silent hang. Roles get one bundle
each, packed on one node by default (colocated), spread when `resources.colocate=false`.
A group of processes that form one torch.distributed world (the trainer's TP ranks) meets at
a file store in a private directory of this executor (`group_store`): nothing listens on a
port for it.

Loopback only. Ray 2.60 rewrites `_node_ip_address="127.0.0.1"` to the node's routable
address (`services.resolve_ip_for_localhost`), and its gRPC servers (GCS, raylet, workers)
then listen on every interface. Ray keeps a local cluster on loopback only when
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (read once, when `ray` is imported: "no multi-node
cluster", the default on macOS/Windows), so the executor sets it before importing Ray and,
once Ray is up, checks the addresses Ray reports — refusing to run if any is not loopback.
The dashboard is off (`include_dashboard=False`: its process runs headless, no HTTP port).
Ray's own token authentication (on by default in 2.60, `RAY_AUTH_MODE`) stays as the user
set it. The roles' process groups (gloo in the trainer and inside vLLM) are pinned to the
loopback interface with `GLOO_SOCKET_IFNAME`.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

RAY_LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class NotLoopbackError(RuntimeError):
    """Ray (or a role) would listen beyond loopback."""


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    names = [n for _, n in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), "lo"))


def role_env() -> dict[str, str]:
    """Environment of every role process: collective backends on the loopback interface."""
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", loopback_interface())}


def is_loopback(address: str) -> bool:
    """Whether an address ("ip", "ip:port", "[v6]:port", an IPv4-mapped v6 address) is on loopback."""
    for host in (address, address.rsplit(":", 1)[0]):
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            continue
        return ip.is_loopback or (getattr(ip, "ipv4_mapped", None) is not None and ip.ipv4_mapped.is_loopback)
    return address.split(":")[0] == "localhost"


def ray_addresses() -> dict[str, str]:
    """The addresses the running Ray reports for this node: node IP, GCS, every node's manager, the dashboard."""
    import ray

    node = ray._private.worker.global_worker.node
    return {"node_ip_address": node.node_ip_address, "gcs_address": node.gcs_address,
            "nodes": ",".join(n["NodeManagerAddress"] for n in ray.nodes()), "dashboard_url": node.address_info.get("webui_url") or ""}


class RoleTimeoutError(TimeoutError):
    """A remote call did not return within run.call_timeout_s."""


class RoleDiedError(RuntimeError):
    """The actor serving a call died (killed, crashed, out of memory)."""


class RoleStartError(RuntimeError):
    """A role's constructor raised (a bad path, a config its code refuses, a missing module): not retried — the same
    start would raise again. The message carries the constructor's exception (its traceback is in the role's log)."""


class _Local:
    def __init__(self, obj, name: str = "role"):
        self.obj, self.name = obj, name

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def async_call(self, method: str, *args, **kwargs) -> Any:
        return self.call(method, *args, **kwargs)

    def wait(self, pending, method: str = "") -> Any:
        return pending

    def restart(self) -> None:
        raise RoleDiedError(f"{self.name}: an in-process role cannot be restarted")


class InProcessExecutor:
    name = "inprocess"

    def __init__(self):
        for k, v in role_env().items():
            os.environ.setdefault(k, v)

    def spawn(self, cls, *args, name: str | None = None, env: dict | None = None, **kwargs) -> _Local:
        """`env` (a role's own variables, e.g. its CUDA_VISIBLE_DEVICES) cannot apply to this shared process: ignored here;
        in-process GPU runs put every role on the process's first GPU."""
        return _Local(cls(*args, **kwargs), name or cls.__name__)

    def group_store(self) -> str:
        raise ValueError("a group of role processes (trainer.tp > 1, rollout.num_engines > 1) needs run.executor=ray")

    @staticmethod
    def share(obj):
        return obj

    def shutdown(self) -> None:
        pass


class _Actor:
    def __init__(self, actor, name: str, timeout_s: float | None, respawn=None, start_timeout_s: float | None = None):
        self.actor, self.name, self.timeout_s, self._respawn = actor, name, timeout_s, respawn
        self.start_timeout_s = start_timeout_s
        self._begin()

    def _begin(self) -> None:
        # the start signal is asked for first, so it runs right after the constructor, ahead of any call (an actor runs
        # its calls in order: asked later, it would wait behind a hung one)
        self._ready, self._started = self.actor.__ray_ready__.remote(), False

    def restart(self) -> None:
        """Kill this actor (if it still lives) and start a fresh one with the same arguments in the same bundle."""
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already dead
            pass
        self.actor = self._respawn()
        self._begin()

    def call(self, method: str, *args, **kwargs) -> Any:
        return self.wait(self.async_call(method, *args, **kwargs), method)

    def async_call(self, method: str, *args, **kwargs):
        return getattr(self.actor, method).remote(*args, **kwargs)  # queued behind the constructor; wait() times it

    def started(self) -> None:
        """Wait (once per actor process) until its constructor has returned, at most start_timeout_s
        (run.start_timeout_s): a call's limit counts the call, never the process start and model load before it
        (a loaded machine can take longer to start a role than to serve a call). A constructor that raised raises
        RoleStartError (with its exception; never retried), a process that died while starting RoleDiedError."""
        wait_started([self])

    def wait(self, ref, method: str = "") -> Any:
        """The result of `ref` (from async_call), waiting at most timeout_s once the actor has started (started())."""
        self.started()
        return self._get(ref, self.timeout_s, method, lambda:
                         f"{self.name}.{method} did not return within {self.timeout_s:g} s (run.call_timeout_s); the role is hung or the "
                         "limit is too short for this model — raise run.call_timeout_s, or resume from the last checkpoint (run.resume=true)")

    def _get(self, ref, limit: float | None, what: str, late) -> Any:
        """ray.get(ref) within `limit`; `late()`: the RoleTimeoutError's message."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=limit)
        except GetTimeoutError:
            raise RoleTimeoutError(late()) from None
        except (ActorDiedError, RayActorError) as e:
            text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
            if "error raised in its creation task" in text:  # Ray's words for a constructor that raised: the cause is last
                cause = [ln.strip() for ln in text.splitlines() if ln.strip()][-1]
                raise RoleStartError(f"{self.name} failed to start: {cause}") from e
            raise RoleDiedError(f"{self.name} died during {what}: {text.splitlines()[0] if text else type(e).__name__}") from e


def wait_started(handles) -> None:
    """Wait for the start of several roles at once (each at most its start_timeout_s): the first that dies or raises
    while starting is named at once (RoleDiedError) — a group's other ranks may wait for it in their constructors' own
    rendezvous, and waiting for them first would hold the run until the start limit. In-process roles are started."""
    import ray

    left = {h._ready: h for h in handles if isinstance(h, _Actor) and not h._started}
    if not left:
        return
    limits = [h.start_timeout_s for h in left.values()]
    limit = None if None in limits else max(limits)
    deadline = None if limit is None else time.monotonic() + limit
    while left:
        ready, _ = ray.wait(list(left), num_returns=1, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not ready:
            names = ", ".join(h.name for h in left.values())
            raise RoleTimeoutError(f"{names} did not start within {limit:g} s (run.start_timeout_s); hung while starting or the "
                                   "limit is too short for this model — raise run.start_timeout_s")
        for ref in ready:
            h = left.pop(ref)
            h._get(ref, None, "start-up", lambda: "")  # ready: its value, or the RoleDiedError of a start that failed
            h._started = True


class RayExecutor:
    name = "ray"

    def __init__(self, num_roles: int = 2, cpus_per_role: float = 1.0, colocate: bool = True, call_timeout_s: float | None = None,
                 object_store_bytes: int = 512 * 1024 * 1024, start_timeout_s: float | None = 1800.0):
        """call_timeout_s: the limit of one remote call; start_timeout_s: of placing the roles and of each role's start
        (process, imports, its constructor: a model load), counted apart from its first call."""
        started = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        # RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0: Ray leaves CUDA_VISIBLE_DEVICES to vime's placement for actors that ask it for
        # no GPUs (2.60's default, stated so another Ray version cannot hide every GPU from the roles)
        self.job_env = {"PYTHONUNBUFFERED": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", **role_env(), **RAY_LOCAL_ONLY}
        if started:
            os.environ.update(RAY_LOCAL_ONLY)  # before `import ray`: its constants read it once
        import ray
        from ray.util.placement_group import placement_group

        if started:
            ray.init(include_dashboard=False, num_cpus=max(int(num_roles * cpus_per_role), os.cpu_count() or 1),
                     object_store_memory=object_store_bytes, log_to_driver=True, configure_logging=False,
                     runtime_env={"env_vars": self.job_env}, _node_ip_address="127.0.0.1")
            addresses = ray_addresses()
            exposed = {k: v for k, v in addresses.items()
                       if (bool(v) if k == "dashboard_url" else not all(map(is_loopback, v.split(","))))}  # any dashboard is too much
            if exposed:
                ray.shutdown()
                raise NotLoopbackError(f"Ray is not on loopback only: {exposed}. `ray` was imported before vime could configure it; "
                                       "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment (or do not import ray before "
                                       "vime.executor)")
        # a Ray the caller started (ray.init before vime) is the caller's cluster: used as it is
        self.pg = placement_group([{"CPU": cpus_per_role}] * num_roles, strategy="PACK" if colocate else "SPREAD")
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(self.pg.ready(), timeout=start_timeout_s)
        except GetTimeoutError:
            raise RoleTimeoutError(f"Ray could not place {num_roles} roles of {cpus_per_role:g} CPU each within {start_timeout_s:g} s "
                                   f"(run.start_timeout_s): {ray.available_resources()} available — free CPUs or lower the layout") from None
        self._next, self._stores = 0, []
        self.cpus, self.num_roles, self.call_timeout_s, self.start_timeout_s = cpus_per_role, num_roles, call_timeout_s, start_timeout_s

    def spawn(self, cls, *args, name: str | None = None, env: dict | None = None, **kwargs) -> _Actor:
        """`env`: variables of this actor's process only (its GPUs: CUDA_VISIBLE_DEVICES, set by vime's placement —
        Ray 2.60 leaves that variable alone for actors that ask Ray for no GPUs)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._next >= self.num_roles:
            raise ValueError(f"RayExecutor: all {self.num_roles} bundles are taken (spawn {cls.__name__})")
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=self._next)
        self._next += 1
        options = {"scheduling_strategy": strategy}
        if env:
            options["runtime_env"] = {"env_vars": {**self.job_env, **env}}
        remote = ray.remote(num_cpus=self.cpus)(cls).options(**options)
        return _Actor(remote.remote(*args, **kwargs), name or cls.__name__, self.call_timeout_s, respawn=lambda: remote.remote(*args, **kwargs),
                      start_timeout_s=self.start_timeout_s)

    def group_store(self) -> str:
        """A fresh file:// rendezvous for one process group, in a directory only this user can read (removed at shutdown)."""
        d = tempfile.mkdtemp(prefix="vime_group_")
        self._stores.append(d)
        return f"file://{d}/store"

    @staticmethod
    def share(obj):
        """One copy of a large argument in Ray's object store for several actors (a ref; Ray resolves it per call)."""
        import ray

        return ray.put(obj)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        for d in self._stores:
            shutil.rmtree(d, ignore_errors=True)
