"""Executors: where roles run. Ray actors in one placement group, or this process.

What this module decides: placement, the calling convention and what the run listens on.
The driver holds only handles; `handle.call(method, ...)` returns the result,
`handle.async_call(method, ...)` returns a future/ref (Ray) that `resolve` turns into the
result. Roles get one bundle each, packed on one node by default (colocated), spread when
`resources.colocate=false`.

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
import socket
import sys
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


class _Local:
    def __init__(self, obj):
        self.obj = obj

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def async_call(self, method: str, *args, **kwargs) -> Any:
        return self.call(method, *args, **kwargs)


class InProcessExecutor:
    name = "inprocess"

    def __init__(self):
        for k, v in role_env().items():
            os.environ.setdefault(k, v)

    def spawn(self, cls, *args, **kwargs) -> _Local:
        return _Local(cls(*args, **kwargs))

    @staticmethod
    def resolve(x):
        return x

    def shutdown(self) -> None:
        pass


class _Actor:
    def __init__(self, actor):
        self.actor = actor

    def call(self, method: str, *args, **kwargs) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args, **kwargs))

    def async_call(self, method: str, *args, **kwargs):
        return getattr(self.actor, method).remote(*args, **kwargs)


class RayExecutor:
    name = "ray"

    def __init__(self, num_roles: int = 2, cpus_per_role: float = 1.0, colocate: bool = True):
        started = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        if started:
            os.environ.update(RAY_LOCAL_ONLY)  # before `import ray`: its constants read it once
        import ray
        from ray.util.placement_group import placement_group

        if started:
            ray.init(include_dashboard=False, num_cpus=max(int(num_roles * cpus_per_role), os.cpu_count() or 1),
                     object_store_memory=512 * 1024 * 1024, log_to_driver=True, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1", **role_env(), **RAY_LOCAL_ONLY}}, _node_ip_address="127.0.0.1")
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
        ray.get(self.pg.ready())
        self._next = 0
        self.cpus = cpus_per_role

    def spawn(self, cls, *args, **kwargs) -> _Actor:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=self._next)
        self._next += 1
        remote = ray.remote(num_cpus=self.cpus)(cls).options(scheduling_strategy=strategy)
        return _Actor(remote.remote(*args, **kwargs))

    @staticmethod
    def resolve(x):
        import ray

        return ray.get(x)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
