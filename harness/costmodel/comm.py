"""Communication: bytes each rank sends per optimizer step, per parallel axis, and their time.

Volumes use the nccl-tests bus factors (NVIDIA nccl-tests doc/PERFORMANCE.md): for a message of S
bytes (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input) over a
group of n ranks, a ring sends per rank
    all_reduce 2(n-1)/n * S     all_gather, reduce_scatter, all_to_all (n-1)/n * S
    send_recv S                 broadcast (ZeroRedundancyOptimizer's parameter sync) (n-1)/n * S,
so with the bus bandwidth B (busbw = algbw * factor) and latency α each call takes
    t = α + factor * S / B                                       (Hockney's α-β model)

Per axis (Ψ_b = a rank's parameter bytes, G = its gradient bytes, m micro-batches of b sequences,
E = b*s*h activation elements, L_r = layers on the rank):
    dp  DDP: one all-reduce of G per step (no_sync on the other micro-batches), bucket by bucket;
        ZeroRedundancyOptimizer: that all-reduce + the updated parameters from their owners;
        FSDP2 / ZeRO-3: all-gather the blocks' params in forward and again in backward (m + 1 times
        over m micro-batches, as harness/strategies/fsdp.py keeps params gathered between
        accumulation steps; once with reshard_after_forward=False, i.e. zero2), the root unit
        (embeddings, ln_f, head) once, + one reduce-scatter of G: (2Ψ + Ψ_blocks)(n-1)/n at m = 1,
        the paper's 3(n-1)/n Ψ up to the root;
        DeepSpeed: stage 0 all-reduce; 1: all-reduce (each rank keeps its partition) + all-gather;
        2: all-reduce every micro-batch + all-gather; 3: all-gather twice + reduce-scatter every
        micro-batch.
    tp  Megatron: 2 all-reduces of E per layer in forward, 2 in backward, per micro-batch (with
        sequence parallel the same bytes as all-gather/reduce-scatter pairs), plus the vocab-parallel
        embedding's forward all-reduce and the head input's backward all-reduce.
    pp  point-to-point E (fp32 residual stream) forward and its gradient backward, per micro-batch
        per stage boundary a rank owns.
    ep  all-to-all of the routed tokens b*s*top_k*h twice in forward (dispatch, combine) and twice
        in backward, per MoE layer per micro-batch.
On gloo (CPU) a reduce-scatter runs as an all-reduce (docs/notes.md#gloo-reduce-scatter): the calibrated
reduce_scatter bus bandwidth already carries that cost, the volumes keep the algorithmic definition.
"""
from __future__ import annotations

FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "send_recv": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}
# calibrate measures these; broadcast is costed as an all-gather of the same bytes
MEASURED_AS = {"broadcast": "all_gather"}


class Link:
    """One (α, bus bandwidth) pair: latency in seconds, bandwidth in bytes/s."""
    __slots__ = ("alpha_s", "bw_Bps")

    def __init__(self, alpha_s: float, bw_Bps: float):
        self.alpha_s, self.bw_Bps = alpha_s, bw_Bps


def collective_link(hw, collective: str, n: int, intra: bool) -> Link:
    """The calibrated figure for this collective at the nearest measured group size (intra-node
    only: calibration runs on one machine), else the hardware's intra/inter-node link."""
    table = hw.collectives.get(MEASURED_AS.get(collective, collective)) if intra else None
    if table:
        best = min(table, key=lambda k: (abs(k - n), -k))
        return table[best]
    return hw.intra if intra else hw.inter


def time_s(link: Link, collective: str, n: int, size_bytes: float, calls: float) -> float:
    """α-β time of `calls` collectives moving `size_bytes` in total (nccl-tests message sizes)."""
    if n <= 1 or calls <= 0:
        return 0.0
    return calls * link.alpha_s + FACTOR[collective](n) * size_bytes / link.bw_Bps


def volume(collective: str, n: int, size_bytes: float) -> float:
    """Bytes one rank sends for messages totalling `size_bytes` over n ranks."""
    return 0.0 if n <= 1 else FACTOR[collective](n) * size_bytes


def dp_ops_scaling(fam: str, zero_stage: int, n: int, param_bytes: float, grad_bytes: float,
                   reshard_after_forward: bool, block_param_bytes: float | None = None) -> list[tuple[str, float, float, str]]:
    """The dp axis' collectives per step as (collective, bytes, bytes per micro-batch, when): total
    message bytes = bytes + m * bytes per micro-batch; when is grad (hides behind backward) |
    params (prefetched behind compute) | step (after backward, exposed). block_param_bytes: the
    part of param_bytes in transformer blocks (FSDP units resharded after forward); default all."""
    if n <= 1:
        return []
    if fam == "replicated":
        return [("all_reduce", grad_bytes, 0.0, "grad")]
    if fam == "zero1_torch":
        return [("all_reduce", grad_bytes, 0.0, "grad"), ("broadcast", param_bytes, 0.0, "step")]
    if fam == "sharded":
        # harness/strategies/fsdp.py: a resharding unit is gathered for the first forward and for
        # every backward; it stays gathered from a non-last backward into the next forward: m + 1.
        # The root unit (embeddings, ln_f, head) is not resharded after forward (fsdp.py passes
        # reshard_after_forward=None for it): gathered once per step. So Ψ + m Ψ_blocks, not (m + 1) Ψ
        # (the profiled window's flight recorder counted 1 + 3 x 4 gathers at m = 2 on model=tiny).
        blocks = param_bytes if block_param_bytes is None else block_param_bytes
        gathers = (param_bytes, blocks) if reshard_after_forward else (param_bytes, 0.0)
        return [("all_gather", *gathers, "params"), ("reduce_scatter", grad_bytes, 0.0, "grad")]
    # deepspeed
    if zero_stage == 0:
        return [("all_reduce", grad_bytes, 0.0, "grad")]
    # Stages 1 and 2 all-reduce each gradient bucket and keep their partition of it: DeepSpeed 0.19's
    # average_tensor with use_multi_rank_bucket_allreduce (default true); the profiled window's flight
    # recorder saw c10d all-reduces of the whole gradients (issue 6 fidelity; was reduce_scatter: 0.6x).
    if zero_stage == 1:
        return [("all_reduce", grad_bytes, 0.0, "grad"), ("all_gather", param_bytes, 0.0, "step")]
    if zero_stage == 2:
        return [("all_reduce", 0.0, grad_bytes, "grad"), ("all_gather", param_bytes, 0.0, "step")]
    return [("all_gather", 0.0, 2 * param_bytes, "params"), ("reduce_scatter", 0.0, grad_bytes, "grad")]


def pp_sends(stages: tuple, n_stages: int) -> int:
    """Point-to-point sends per micro-batch of a pp rank: forward unless last, backward unless first."""
    return sum(int(st < n_stages - 1) + int(st > 0) for st in stages)
