"""Worker extension for vLLM: versioned in-place weight updates of the strict model.

What this module decides: how new weights reach a running engine. The trainer
writes HF-named tensors to a safetensors file (tensors do not survive vLLM's
RPC serialisation between processes, paths do); every worker copies them into
the model's parameters in place and stamps the model with the new version.
The caller then resets the prefix cache (cached KV was computed with the old
weights). Loaded through `worker_extension_cls`, vLLM's official hook.
Where the trainer shares a worker's device (colocated GPUs; the CPU), `rlkernel_load_ipc` takes the
trainer's tensors as IPC handles instead — each worker those of the trainer rank on its own device: a
device-to-device copy on a GPU, no file.
"""
from __future__ import annotations


def device_ident(kind: str) -> str:
    """Which physical device this process's current `kind` ("cuda" or "cpu") is, the same string in every process that
    sees it: the GPU's UUID (whatever CUDA_VISIBLE_DEVICES numbers it), or the host for CPU memory."""
    import socket

    import torch

    if kind == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        uuid = getattr(props, "uuid", None)  # torch >= 2.1; else the PCI address (also unique on one host)
        where = uuid if uuid is not None else ":".join(str(getattr(props, k, "?")) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
        return f"cuda:{where}@{socket.gethostname()}"
    return "cpu:" + socket.gethostname()


def pick_handles(payloads: list[dict], rank: int, kind: str) -> dict:
    """The IPC handles TP rank `rank` of an engine opens: payloads[rank] (one trainer rank's {"device", "rank",
    "handles"}, vime.roles.handles_for_engines), after checking it was made on this worker's own device — CUDA IPC opens
    only there, and another placement would be a silent wrong copy or a crash."""
    if not 0 <= rank < len(payloads):
        raise RuntimeError(f"engine worker of TP rank {rank} got handles for {len(payloads)} worker(s)")
    mine, here = payloads[rank], device_ident(kind)
    if mine["device"] != here:
        raise RuntimeError(f"engine worker of TP rank {rank} is on {here} but its weight handles come from trainer rank {mine['rank']} "
                           f"on {mine['device']}: the engines and trainer ranks must share devices in gpu_placement's order "
                           "(set rollout.weight_sync=host for other layouts)")
    return mine["handles"]


def open_ipc_handles(handles: dict) -> dict:
    """HF name -> tensor from torch's IPC reductions (rebuild function, args) of another process's CUDA tensors: what
    the strict worker loads, and what vime hands a stock engine's reload. The caller synchronises after copying, before
    the sender may free or overwrite them."""
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}


class StrictWorkerExtension:
    def _load(self, tensors: dict, version: int) -> dict:
        """Copy HF-named tensors into the model's parameters in place and stamp the version."""
        model = self.model_runner.get_model()  # the model itself, also under vLLM's CUDA-graph wrapper
        model.load_hf_weights(tensors)
        model.weight_version = int(version)
        return {"version": model.weight_version, "tensors": len(tensors)}

    def rlkernel_load_weights(self, path: str, version: int) -> dict:
        from safetensors.torch import load_file

        return self._load(load_file(path, device=str(next(self.model_runner.get_model().parameters()).device)), version)

    def rlkernel_load_tensors(self, tensors: dict, version: int) -> dict:
        """The same update from tensors handed over in memory (an engine whose worker runs in the caller's process)."""
        return self._load(tensors, version)

    def rlkernel_load_ipc(self, payloads: list[dict], version: int) -> dict:
        """The same update from tensors a trainer process on this worker's device shares: `payloads` holds one trainer
        rank's {"device", "rank", "handles"} per TP rank of this engine (handles: HF names to torch's IPC reduction,
        (rebuild function, args)); this worker opens its own rank's, copies them into the model, and releases them."""
        import torch

        model = self.model_runner.get_model()
        on = next(model.parameters()).device
        rank = model.tp.rank if getattr(model, "tp", None) is not None else 0
        out = self._load(open_ipc_handles(pick_handles(payloads, rank, on.type)), version)
        if on.type == "cuda":
            torch.cuda.synchronize()  # the copies are done before the sender may free or overwrite its tensors
        return out | {"from_rank": payloads[rank]["rank"]}

    def rlkernel_weight_digests(self) -> dict:
        """{HF name: digest of this rank's tensor}: what the model holds now (a check that an update arrived as sent;
        `vime parity --check-weights`). A tied lm_head is not a parameter of its own."""
        from ..golden import digest

        return {name: digest([p]) for name, p in self.model_runner.get_model().named_parameters()}

    def rlkernel_take_provenance(self) -> dict:
        """rlkernel op calls since the last take: {op: [{backend, contract_id, device, calls}]}. Under CUDA graphs the
        calls of replayed decode steps are not counted (a replay runs no Python); the ops and contracts are those the
        eager steps and the capture recorded."""
        return self.model_runner.get_model().provenance.take()

    def rlkernel_weight_version(self) -> int:
        return int(getattr(self.model_runner.get_model(), "weight_version", -1))

    def rlkernel_info(self) -> dict:
        from ..backends import cpu, triton

        model = self.model_runner.get_model()  # the model itself, also under vLLM's CUDA-graph wrapper
        attn = getattr(model, "attn", None)
        on_cpu = next(model.parameters()).device.type == "cpu"
        return {
            "cpu_kernels": cpu.status() if on_cpu else None,  # status() builds the CPU kernels: only where they run
            "gpu_kernels": None if on_cpu else triton.status(),  # the Triton kernels' golden check on this GPU
            "model_class": type(model).__name__,
            "attention_impl": type(attn[0].impl).__name__ if attn else None,
            "temperature": getattr(model, "rollout_temperature", None),
            "policy": repr(getattr(model, "policy", None)),
            "weight_version": self.rlkernel_weight_version(),
            "tp": [model.tp.rank, model.tp.world] if getattr(model, "tp", None) is not None else [0, 1],  # [rank, world]
            # how the row-parallel merges gather: vLLM's own TP communicator, or torch.distributed on its device group
            "tp_gather": None if getattr(model, "tp", None) is None else ("vllm" if model.tp.gather else "torch.distributed"),
            "row_segments": getattr(getattr(model, "config", None), "row_segments", None),
            "runner": type(self.model_runner).__module__ + "." + type(self.model_runner).__name__,
            "logprobs_mode": getattr(model, "logprobs_mode", None),
            "contract_sampler": bool(getattr(model, "contract_sampler", False)),  # V2: reported logprobs via the wrapper
            "contract_sampler_calls": int(getattr(model, "contract_sampler_calls", 0)),  # sampler steps it has served so far
            "compile_ahead": getattr(model, "compile_ahead_stats", None),  # GPU: the Triton kernels compiled ahead at start
        }


def stock_load_ipc(worker, payloads: list[dict], tied: bool) -> dict:
    """Runs inside a stock vLLM worker (collective_rpc with this function, vLLM's official way to run code on its
    workers; no extension class, so the stock engine stays stock): its TP rank's handles opened and handed to vLLM's own
    `reload_weights(weights_iterator=...)` where they are (on the GPU: no host copy)."""
    import torch

    from . import vllm_compat

    kind = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    rank = vllm_compat.worker_tp_rank()
    tensors = vllm_compat.checkpoint_tensors(open_ipc_handles(pick_handles(payloads, rank, kind)), tied, on_device=True)
    worker.reload_weights(weights_iterator=list(tensors.items()), is_checkpoint_format=True)
    if kind == "cuda":
        torch.cuda.synchronize()
    return {"tp_rank": rank, "from_rank": payloads[rank]["rank"], "tensors": len(tensors)}
