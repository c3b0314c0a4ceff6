"""Executors: where roles run. Ray actors in one placement group, or this process.

What this module decides: placement and the calling convention. The driver
holds only handles; `handle.call(method, ...)` returns the result,
`handle.async_call(method, ...)` returns a future/ref (Ray) that `resolve`
turns into the result. Ray starts locally with the dashboard off and listens
on loopback only; roles get one bundle each, packed on one node by default
(colocated), spread when `resources.colocate=false`.
"""
from __future__ import annotations

import os
from typing import Any


class _Local:
    def __init__(self, obj):
        self.obj = obj

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def async_call(self, method: str, *args, **kwargs) -> Any:
        return self.call(method, *args, **kwargs)


class InProcessExecutor:
    name = "inprocess"

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
        import ray
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init(include_dashboard=False, num_cpus=max(int(num_roles * cpus_per_role), os.cpu_count() or 1),
                     object_store_memory=512 * 1024 * 1024, log_to_driver=True, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONUNBUFFERED": "1"}}, _node_ip_address="127.0.0.1")
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
