"""The ring all-reduce, step by step, for the DP mode's animation (and its bytes).

n ranks in a ring, each holding a gradient of G bytes cut into n chunks. Patarasuk & Yuan 2009 /
NCCL's ring:

    reduce-scatter, step k = 0 .. n-2:  rank i sends chunk (i - k) mod n to rank i+1, which adds it
                                        to its own copy; after n-1 steps rank i holds the fully
                                        reduced chunk (i + 1) mod n
    all-gather,     step k = 0 .. n-2:  rank i sends chunk (i + 1 - k) mod n (fully reduced) to rank
                                        i+1, which overwrites its copy; after n-1 steps every rank
                                        holds every reduced chunk

Each step every rank sends one chunk (G/n bytes), so a rank sends 2 (n-1)/n * G bytes per all-reduce:
the "bus bandwidth" factor of nccl-tests. ZeRO-2/3 and FSDP run the two halves as separate
collectives (reduce-scatter of grads, all-gather of params): (n-1)/n * G each.
"""
from __future__ import annotations


def allreduce_bytes_per_rank(grad_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of `grad_bytes`: 2 (n-1)/n * G."""
    return 2.0 * (n - 1) / n * grad_bytes if n > 1 else 0.0


def steps(n: int) -> list[dict]:
    """Every step of a ring all-reduce among n ranks. Each entry: phase, index, the transfers
    (src, dst, chunk) and the state after it: state[rank][chunk] = how many ranks' gradients that
    copy of the chunk sums (n = fully reduced)."""
    assert n >= 1, n
    state = [[1] * n for _ in range(n)]
    out = [{"phase": "start", "k": 0, "sends": [], "state": [row[:] for row in state]}]
    for k in range(n - 1):
        sends = [(i, (i + 1) % n, (i - k) % n) for i in range(n)]
        incoming = {dst: state[src][c] for src, dst, c in sends}  # values sent are those before the step
        for _src, dst, c in sends:
            state[dst][c] += incoming[dst]
        out.append({"phase": "reduce-scatter", "k": k, "sends": sends, "state": [row[:] for row in state]})
    for k in range(n - 1):
        sends = [(i, (i + 1) % n, (i + 1 - k) % n) for i in range(n)]
        incoming = {dst: state[src][c] for src, dst, c in sends}
        for _src, dst, c in sends:
            state[dst][c] = incoming[dst]
        out.append({"phase": "all-gather", "k": k, "sends": sends, "state": [row[:] for row in state]})
    return out
