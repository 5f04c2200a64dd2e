"""What the planner's table says beside its numbers: the node and fabric it priced (the header), and for
each layout why it ranks where it does (harness/plan.py; a candidate is plan.Candidate)."""
from __future__ import annotations

from harness.costmodel.fabric import Fabric


def network(run) -> str:
    """The node and the fabric the table is priced on (the header's second line)."""
    hw = run.hardware
    node = f"node: {hw.devices_per_node} x {hw.name}, {hw.intra_node.bus_bw_GBps:g} GB/s busbw inside"
    fabric = Fabric.of(hw.fabric)
    if fabric is not None:
        return f"{node}; fabric: {fabric.describe()}"
    return (f"{node}; fabric: none named, the profile's inter_node link ({hw.inter_node.nics_per_node} x "
            f"{hw.inter_node.bus_bw_GBps:g} GB/s; hardware/fabric=<name> of conf/hardware/fabric/ prices a measured one)")


def why(c, nxt, mem_bytes: float) -> str:
    """What this layout spends its step on, its headroom, and what separates it from the next one."""
    p = c.pred
    head = (mem_bytes - p["peak_mem_bytes"]) / 1024**3
    slowed = 100 * p["comm_interference_time_s"] / p["step_time_s"]  # compute under collectives
    text = (f"η {100 * p['efficiency']:.0f}%: exposed comm {p['comm_exposed_pct']:.1f}%, "
            + (f"compute slowed under comm {slowed:.1f}%, " if slowed >= 0.05 else "")
            + f"bubble {p['bubble_pct']:.1f}%, {head:.1f} GiB free")
    if nxt is None:
        return text
    q = nxt.pred
    gain = 100 * (p["tokens_per_s"] / q["tokens_per_s"] - 1)
    if c.ckpt != nxt.ckpt:  # what makes the compute differ: recompute, else the GEMMs' shapes
        compute = f"less compute ({c.ckpt} vs {nxt.ckpt} checkpointing)"
    else:
        compute = f"less compute (GEMMs at tp {c.tp} mb {c.mb} vs tp {nxt.tp} mb {nxt.mb})"
    diffs = {"less exposed comm": q["comm_exposed_time_s"] - p["comm_exposed_time_s"],
             "less comm under compute": q["comm_interference_time_s"] - p["comm_interference_time_s"],
             "smaller bubble": q["bubble_time_s"] - p["bubble_time_s"],
             compute: q["compute_time_s"] - p["compute_time_s"]}
    reason, delta = max(diffs.items(), key=lambda kv: kv[1])
    if gain < 0.05 or delta <= 0:
        return text + "; tie with the next"
    return text + f"; +{gain:.1f}% over next: {reason}"
