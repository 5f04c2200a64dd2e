"""What a run is called wherever it is shown (table, report, fidelity, run dirs, W&B): its strategy
and degrees, then what sets it apart from the runs it is shown with.

    ddp dp2                       # a study whose runs differ only in strategy and degrees
    ddp dp2 ac=full               # ... and one of them checkpoints activations
    pp pp2 vpp2 zbv_zero_bubble   # the schedule is named whenever the run is a pipeline

In a study the extras are the config values that differ between its runs (`labels`). A run on its
own (its run dir, its W&B name) has no others to differ from: the extras are the overrides it was
given (`own_label`). Pure: no torch, no Hydra.
"""
from __future__ import annotations

import html
import math

from harness.config import NON_SEMANTIC_KEYS, flatten, renamed
from harness.dims import DEGREES, degrees

# Shown in the base label (strategy, engine, degrees, schedule), never again as an extra.
IN_BASE = ("strategy.name", "strategy.engine", "strategy.schedule", "strategy.zero_stage", "strategy.axes",
           "strategy.impl", "parallel.", "study")
# Where a figure comes from (a hardware profile's `source` notes), not what was run.
NOT_WHAT_RUNS = ("hardware.source.",)
# The keys a reader knows by a short name; "" = the value alone says it (bf16-mixed, gpt2_124m, strong).
SHORT = {"workload.activation_checkpointing": "ac", "workload.global_batch_size": "batch",
         "workload.micro_batch_size": "mbs", "workload.num_microbatches": "m", "workload.precision": "",
         "model.name": "", "hardware.name": "", "series": "", "strategy.sequence_parallel": "sp",
         "strategy.loss_parallel": "loss_parallel", "strategy.comm_hook": "hook", "strategy.data_parallel": "data_parallel",
         "strategy.dp_shard": "data_parallel"}
# How long a run is measured, not what it is: left out of a run's own label (its run dir, W&B name).
MEASUREMENT_LENGTH = ("workload.warmup_steps", "workload.steps", "workload.profile_steps", "launcher.timeout_s")
# A group's other keys differ whenever its option differs (model=small vs tiny): named by the option.
GROUP_OPTION = {"model": "model.name", "hardware": "hardware.name", "strategy": "strategy.name"}


def _dims(record: dict) -> dict:
    if record.get("dims"):
        return record["dims"]
    par = ((record.get("config") or {}).get("parallel") or {})
    return {a: par[a] for a in DEGREES if isinstance(par.get(a), int)}


def base_label(record: dict) -> str:
    """strategy [DeepSpeed ZeRO-n] degrees [schedule]."""
    s = (record.get("config") or {}).get("strategy") or {}
    name = record.get("strategy") or s.get("name") or "?"
    if s.get("engine") == "deepspeed":
        stage = f" ZeRO-{s['zero_stage']}" if s.get("zero_stage") else ""
        name += f" (DeepSpeed{stage})"
    d = _dims(record)
    parts = [name] + ([degrees(d)] if degrees(d) != "1" else [])
    if (d.get("pp") or 1) > 1 and s.get("schedule"):
        parts.append(str(s["schedule"]))
    return " ".join(parts)


def _shown(key: str) -> bool:
    return key.split(".")[0] not in NON_SEMANTIC_KEYS and not any(
        key == b or (b.endswith(".") and key.startswith(b)) for b in IN_BASE + NOT_WHAT_RUNS)


def _extra(key: str, value) -> str:
    short = SHORT.get(key, key.rsplit(".", 1)[-1])
    if isinstance(value, bool):
        value = str(value).lower()
    return f"{short}={value}" if short else str(value)


def differing_keys(records: list[dict]) -> dict[str, set | None]:
    """Config keys whose values are not the same in every record (in config order), each with the
    group options it differs within. A group's inner keys count only between runs of the same option
    (model.n_layers between two `small` runs; strategy.data_parallel between two 3d runs, so a tp run
    beside them is not labelled with a knob it never reads); None for a key outside any group."""
    flats = [renamed(flatten(r.get("config") or {})) for r in records]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    out: dict[str, set | None] = {}
    for k in keys:
        if not _shown(k):
            continue
        option = GROUP_OPTION.get(k.split(".")[0])
        by_option: dict = {}
        for f in flats:  # a record without the key (a config that never composed, an older schema) says nothing
            if k in f:
                by_option.setdefault(f.get(option) if option and option != k else None, set()).add(repr(f[k]))
        within = {o for o, values in by_option.items() if len(values) > 1}
        if within:
            out[k] = None if within == {None} else within
    return out


def labels(records: list[dict]) -> list[str]:
    """One label per record (same order), each with the values that set it apart; a label two
    different configs would still share gets its run_id's head."""
    keys = differing_keys(records)
    out = []
    for r in records:
        flat = renamed(flatten(r.get("config") or {}))
        extras = [_extra(k, flat[k]) for k, within in keys.items() if flat.get(k) not in (None, "")
                  and (within is None or flat.get(GROUP_OPTION[k.split(".")[0]]) in within)]
        out.append(" ".join([base_label(r)] + extras))
    seen: dict[str, set] = {}
    for r, lab in zip(records, out):
        seen.setdefault(lab, set()).add(r.get("run_id"))
    return [f"{lab} #{str(r.get('run_id'))[:6]}" if len(seen[lab]) > 1 else lab for r, lab in zip(records, out)]


def own_label(record: dict, overrides: list[str]) -> str:
    """A run named on its own: base label plus the overrides it was given that the base does not
    say (`ddp dp2 ac=full`); the launcher, logger, group options (model=, hardware=) and how many
    steps are measured are left out."""
    extras = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if (("." not in key and key not in SHORT) or key.split(".")[0] == "hydra" or key in MEASUREMENT_LENGTH
                or not _shown(key)):
            continue
        extras.append(_extra(key, value))
    return " ".join([base_label(record)] + extras)


def slug(label: str) -> str:
    """A label as a file or W&B name: `pp-pp2-vpp2-zbv_zero_bubble-ac=full`."""
    keep = "".join(c if c.isalnum() or c in "_=.-" else "-" for c in label)
    return "-".join(p for p in keep.split("-") if p)


# -- fmt -------------------------------------------------------------------------------------------
# Number formatting for the report: one place, so the page, the PNGs and the tests agree.
#
# Every formatter takes None (a figure that was not measured or not predicted) and returns NA.

NA = "not measured"
NP = "not predicted"


def _bad(x) -> bool:
    return x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or math.isinf(x)


def num(x, digits: int = 3, none: str = NA) -> str:
    """3 significant digits, no exponent for everyday magnitudes."""
    if _bad(x):
        return none
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - mag)
    return f"{x:,.{decimals}f}"


def ci_text(ci, none: str = "-") -> str:
    """A 95 % interval of a rate as "lo-hi" (whole numbers); `none` when there is none."""
    return none if not ci or _bad(ci[0]) or _bad(ci[1]) else f"{ci[0]:,.0f}-{ci[1]:,.0f}"


def seconds(x, none: str = NA) -> str:
    if _bad(x):
        return none
    if abs(x) < 1:
        return f"{num(x * 1e3)} ms"
    return f"{num(x)} s"


def rate(x, none: str = NA) -> str:
    """tokens/s and similar: whole numbers with thousands separators."""
    return none if _bad(x) else f"{x:,.0f}"


def pct(x, none: str = NA) -> str:
    return none if _bad(x) else f"{x:.1f}%"


def nbytes(n, none: str = NA) -> str:
    """Binary units (KiB = 1024 B), as the rest of brigade prints them."""
    if _bad(n):
        return none
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ratio(measured, predicted) -> float | None:
    if _bad(measured) or _bad(predicted) or predicted == 0:
        return None
    return measured / predicted


def ratio_class(r) -> str:
    """Colour class of a measured/predicted ratio: within 10% good, within 50% fair, else poor."""
    if r is None:
        return "r-none"
    dev = abs(math.log(r)) if r > 0 else math.inf
    if dev <= math.log(1.10):
        return "r-good"
    if dev <= math.log(1.50):
        return "r-fair"
    return "r-poor"


def esc(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)
