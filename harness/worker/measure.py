"""Measurement primitives: device-synchronised step timing, exact local tensor bytes, peak memory.

Model-state memory is counted as the exact bytes of the tensors a rank holds (a DTensor counts its
local shard), which shows sharding exactly; process RSS on CPU does not (allocator caching, the full
model built before sharding), so it is reported only as a labelled sanity figure.
"""
from __future__ import annotations

import resource
import time

import torch



def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # DTensor: only the shard this rank holds
    return to_local() if callable(to_local) else t


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors count once)."""
    seen, total = set(), 0
    for t in tensors:
        t = local_tensor(t)
        if t is None or t.device.type == "meta":
            continue
        # the StorageImpl, not data_ptr: fake tensors (launcher=dryrun) have no data pointer
        key = (t.device, t.untyped_storage()._cdata, t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def model_state_bytes(state: dict[str, list]) -> dict[str, int]:
    out = {f"{k}_bytes": tensor_bytes(v) for k, v in state.items()}
    out.setdefault("params_bytes", 0)
    out.setdefault("grads_bytes", 0)
    out.setdefault("optimizer_bytes", 0)
    out["model_states_bytes"] = sum(out.values())
    return out


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int | str]:
    if device.type == "cuda":
        return {"peak_mem_bytes": torch.cuda.max_memory_allocated(device),
                "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "peak_mem_kind": "cuda_max_allocated", **nvml_memory(device)}
    # Linux reports ru_maxrss in KiB. Whole-process peak RSS, not tensor memory: a sanity figure.
    return {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_mem_kind": "cpu_peak_rss"}


def nvml_memory(device: torch.device) -> dict[str, int]:
    """Device memory in use as NVML sees it (allocator reserve + CUDA context + other processes),
    read once after the timed steps (torch.cuda.device_memory_used maps CUDA_VISIBLE_DEVICES to
    NVML's index); {} without nvidia-ml-py, which is optional (`pip install nvidia-ml-py`)."""
    try:
        return {"device_mem_used_nvml_bytes": int(torch.cuda.device_memory_used(device))}
    except Exception:  # noqa: BLE001 - NVML is a cross-check, never a reason to fail a run
        return {}


class Clock:
    """Time of a region with the device synchronised at both ends. On CUDA the elapsed time is the
    device's, from CUDA events recorded around the region (what the GPU spent, launch gaps
    included); the host wall time is kept as `host_elapsed`. On CPU both are the wall time."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        synchronize(self.device)
        if self.device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.events[1].record()
        synchronize(self.device)
        self.host_elapsed = self.elapsed = time.perf_counter() - self.t0
        if self.device.type == "cuda":
            self.elapsed = self.events[0].elapsed_time(self.events[1]) / 1e3  # ms -> s
        return False
