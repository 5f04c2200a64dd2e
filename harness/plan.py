"""`python -m harness.plan`: search parallel layouts for a model on N devices with the cost model.

    python -m harness.plan model=gpt_70b hardware=h100_sxm plan.gpus=1024 plan.top_k=10 \\
        workload.global_batch_size=2048 workload.precision=bf16-mixed
    python -m harness.plan model=small hardware=cpu_calibrated plan.gpus=4 --run-top 2 logger=none

Enumerates every (dp, tp, pp, vpp + schedule, ep, ZeRO stage, sequence parallel when tp > 1, HSDP's
replica count R for FSDP2 layouts (dp = R x shard group), bf16 parameters for the distributed optimizer
under bf16-mixed, micro-batch size, checkpointing) with
dp*tp*pp = plan.gpus that brigade can run: the global batch is the workload's
(workload.global_batch_size sequences), so the micro-batch count is m = global / (dp * micro-batch);
degrees must divide heads, d_ff and experts as harness/validate.py requires (pp * vpp need not divide the
layers: models/pipeline_split.py splits them as evenly as they allow); each layout maps
to an existing strategy (harness/catalog.py strategy_for). Each candidate is evaluated by the same functions
`harness.predict` uses (harness.costmodel: `layout` once per parallel layout, then for every micro-batch size and
checkpointing mode `memory_peak` and, for what fits the device, `finish`; maxima only). A layout is ranked, by
predicted tokens/s, where its predicted peak fits the device's memory less its family's memory margin (how far the
validation runs of its layout family measured above their predicted peak, p90: harness/costmodel/family_errors.py
`memory_limit`), so that the planner does not recommend a layout its own error would put out of memory;
plan.memory_margin=false ranks every layout whose predicted peak fits. The table says why each wins: its efficiency and what it loses to
exposed communication and the bubble, its memory headroom, and what separates it from the next one; and how sure
each prediction is: its layout family's validation error (harness/costmodel/family_errors.py). Where a layout
`--run-top K` would run is of a family whose error is large, an `unsure:` line says so and recommends that K.

`--run-top K` (or plan.run_top=K) hands the best K distinct layouts (by default distinct parallel
degrees dp, dp_replicate, tp, pp, ep, each with its best strategy, schedule, ZeRO stage, micro-batch size and
checkpointing; plan.run_top_by=variant tells schedules and ZeRO stages apart too) to the launcher as one sweep: it runs
`python -m harness -m <your overrides> study=<plan study> hydra.sweeper.runs=[[...], ...]`, the
brigade sweeper's list of runs (hydra_plugins/brigade_sweeper), so each gets a record with its
measurement beside this prediction; then it prints predicted vs measured rank, Spearman's rho and
whether the predicted best is within 10 % of the measured best (tools/plan_check.py). The last line is always
`evaluated N configs in S s (R configs/s)`.
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from harness import catalog
from harness.config import CONF_DIR, StrategyConfig, compose_run
from harness.costmodel import family_errors
from harness.costmodel.estimate import finish, step_timing
from harness.costmodel.flops import model_flops_per_step
from harness.costmodel.inputs import Hardware, Model, StrategyKnobs, ranks_per_node
from harness.costmodel.layout import layout, node_crossing_axes
from harness.costmodel.memory_peak import memory_peak, rank_activations
from harness.dims import AXES, DEGREES, family
from harness.run.results_file import read, records_path
from harness.run.signals import install_signals
from harness.tools import plan_check
from harness.tools.plan_dryrun import dryrun_top
from harness.tools.plan_reasons import network, why
from harness.tools.plan_space import (
    candidate_workload,
    divisors,
    hsdp_dims,
    hsdp_prediction,
    hsdp_replicas,
    with_low_precision_params,
    with_sequence_parallel,
)
from harness.validate import available_strategies

# (schedule, the vpp values tried) for pp > 1, from the catalog; one stage per rank when pp = 1
SCHEDULES_VPP = tuple((name, row.plan_vpps) for name, row in catalog.SCHEDULES.items() if row.plan_vpps)
MICRO_BATCHES = (1, 2, 4, 8, 16)
CHECKPOINTING = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)


@functools.lru_cache(maxsize=None)
def strategy_defaults(name: str) -> dict:
    """The scalar knobs conf/strategy/<name>.yaml sets (zero_stage, reshard_after_forward, ...)."""

    fields = set(StrategyConfig.__dataclass_fields__) - {"name", "engine", "ds", "schedule"}
    values = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "strategy" / f"{name}.yaml"))
    return {k: v for k, v in values.items() if k in fields}


class Candidate:
    __slots__ = (*DEGREES, "zero", "mb", "m", "ckpt", "schedule", "strategy", "knobs", "pred", "crosses")

    def __init__(self, dp, tp, pp, vpp, ep, zero, mb, m, ckpt, schedule, strategy, knobs, pred, dp_replicate=1,
                 crosses=()):
        self.dp, self.tp, self.pp, self.vpp, self.ep, self.zero = dp, tp, pp, vpp, ep, zero
        self.mb, self.m, self.ckpt, self.schedule, self.strategy, self.knobs, self.pred = (
            mb, m, ckpt, schedule, strategy, knobs, pred)
        self.dp_replicate = dp_replicate  # HSDP: FSDP over dp / dp_replicate ranks, replicated dp_replicate times
        self.cp = 1  # the planner does not search context parallelism
        self.crosses = crosses  # the axes whose groups span nodes (layout.node_crossing_axes)

    def overrides(self) -> list[str]:
        out = [f"strategy={self.strategy}"]
        out += [f"strategy.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.knobs.items()]
        if self.pp > 1:
            out.append(f"strategy.schedule={self.schedule}")
        for axis in DEGREES:
            if getattr(self, axis) > 1:
                out.append(f"parallel.{axis}={getattr(self, axis)}")
        out += [f"workload.micro_batch_size={self.mb}", f"workload.activation_checkpointing={self.ckpt}"]
        return out


def search(run, gpus: int, shortcuts: bool = True) -> tuple[list[Candidate], dict]:
    """Evaluate every runnable layout; return (feasible candidates best first, counts). shortcuts: share
    what does not depend on dp among a layout's HSDP variants (activations, per-token costs) and what does not
    depend on the peak among them (the whole dp's time), and reject a config once its peak is certain to
    exceed the device's memory (memory_peak's `over`); without them every config is priced on its own, in
    full (the same list: tests/test_plan_search.py)."""
    m_cfg, hw_cfg, w = run.model, run.hardware, run.workload
    md, hw = Model.of(m_cfg), Hardware.of(hw_cfg)
    gbs, precision = w.global_batch_size, w.precision
    have = set(available_strategies())
    L, heads, d_ff, E = m_cfg.n_layers, m_cfg.n_heads, m_cfg.d_ff, m_cfg.n_experts
    nodes = run.launcher.nodes
    mem_limit = hw.memory_bytes
    rpn = ranks_per_node(hw, gpus, nodes)
    margin = run.plan.memory_margin
    knob_cache: dict = {}

    def knobs_for(name, extra, schedule):
        key = (name, tuple(sorted(extra.items())), schedule)
        if key not in knob_cache:
            # the strategy's own conf/strategy/<name>.yaml values (zero stage, resharding), then the layout's
            base = replace(run.strategy, **{"zero_stage": 0, **strategy_defaults(name)})
            knob_cache[key] = StrategyKnobs.of(replace(base, name=name, schedule=schedule, engine="torch", **extra),
                                                run.runtime)
        return knob_cache[key]

    feasible, evaluated, over_memory, over_margin, t0 = [], 0, 0, 0, time.perf_counter()
    for tp in divisors(gpus):
        if heads % tp or d_ff % tp:
            continue
        for pp in divisors(gpus // tp):
            if L < pp:  # every stage holds a block; an uneven split is models/pipeline_split.py's rule
                continue
            dp = gpus // (tp * pp)
            schedules = SCHEDULES_VPP if pp > 1 else ((catalog.DEFAULT_SCHEDULE, (1,)),)
            eps = [e for e in divisors(dp) if E and E % e == 0] if E else [1]
            for ep in eps:
                # the largest peak ranked: the device's memory less the family's memory margin (family_errors.py)
                limit = (family_errors.memory_limit(mem_limit, family({"dp": dp, "tp": tp, "pp": pp, "ep": ep}, rpn),
                                                    hw.device) if margin else mem_limit)
                for zero in ZERO_STAGES[:1] if dp == 1 else ZERO_STAGES:  # nothing to shard over one rank
                    strat = catalog.strategy_for(dp, tp, pp, ep, zero)
                    if strat is None or strat[0] not in have or \
                            not catalog.data_parallel_runs(strat[1].get("data_parallel", ""), dp, tp, E):
                        continue
                    for knobs in (v for sp in with_sequence_parallel(strat[1], tp, m_cfg)
                                  for v in with_low_precision_params(sp, precision)):
                        for schedule, vpps in schedules:
                            for vpp in vpps:
                                if L < pp * vpp:
                                    continue
                                st = knobs_for(strat[0], knobs, schedule)
                                # HSDP (FSDP2 only): also shard over dp / R ranks, replicated R times
                                reps = (hsdp_replicas(dp, gpus, ranks_per_node(hw, gpus, nodes))
                                        if st.state_sharding == "sharded" and ep == 1 else ())
                                lo, shards = None, {}
                                for mb in MICRO_BATCHES:
                                    if gbs % (dp * mb):
                                        continue
                                    m = gbs // (dp * mb)
                                    if pp > 1 and catalog.microbatch_rule_broken(schedule, "torch", pp, vpp, m):
                                        continue  # the schedule refuses this micro-batch count (validate.py)
                                    if lo is None:  # what micro-batching and checkpointing do not change, once
                                        lo = layout(md, hw, st, dp, tp, pp, vpp, ep, precision, nodes)
                                        crosses = node_crossing_axes(lo.place)
                                        shards = {r: (layout(md, hw, st, dp // r, tp, pp, vpp, ep, precision, nodes,
                                                             per_token=lo.per_token if shortcuts else None),
                                                      hsdp_dims(lo, r)) for r in reps}
                                        for shard, _ in shards.values() if shortcuts else ():
                                            if (shard.place.slowdown, shard.place.mem_slowdown) == \
                                                    (lo.place.slowdown, lo.place.mem_slowdown):
                                                shard.mb_times = lo.mb_times  # the same rates: the same layer times
                                    for ckpt in CHECKPOINTING:
                                        # what no replica count changes: the activations (no dp in them) and,
                                        # of the whole dp's prediction, its time (no peak in it), once
                                        acts = rank_activations(lo, mb, m, ckpt) if shortcuts else None
                                        timing, w_c = None, None
                                        for rep in (1, *reps):
                                            evaluated += 1
                                            lo_states, dims_rep = shards[rep] if rep > 1 else (lo, None)
                                            # no time for what cannot fit
                                            peak = memory_peak(lo_states, mb, m, ckpt, acts, mem_limit if shortcuts else None)
                                            if peak is None or peak.peak_bytes > limit:
                                                over_memory += 1
                                                over_margin += peak is not None and peak.peak_bytes <= mem_limit
                                                continue
                                            if not shortcuts or timing is None:
                                                timing = step_timing(lo, mb, m, ckpt)
                                            pred = finish(lo, mb, m, ckpt, peak, timing)
                                            if rep > 1:
                                                w_c = w_c or candidate_workload(run, precision, mb, ckpt)
                                                shard_timing = step_timing(lo_states, mb, m, ckpt, timing if shortcuts else None)
                                                pred = hsdp_prediction(pred, finish(lo_states, mb, m, ckpt, peak, shard_timing),
                                                                       lo, st, run, hw, m, w_c, dims_rep)
                                            feasible.append(Candidate(dp, tp, pp, vpp, ep, zero, mb, m, ckpt, schedule,
                                                                      strat[0], knobs, pred, rep, crosses))
    feasible.sort(key=lambda c: -c.pred["tokens_per_s"])
    return feasible, {"evaluated": evaluated, "over_memory": over_memory, "over_margin": over_margin,
                      "seconds": time.perf_counter() - t0}


def table(cands: list[Candidate], k: int, run, counts: dict):

    hw = run.hardware
    gib = hw.memory_GiB
    rpn = ranks_per_node(Hardware.of(hw), counts["gpus"], run.launcher.nodes)
    peak = hw.peak_tflops.get(catalog.PEAK_KEY[run.workload.precision])
    flops = model_flops_per_step(run.model, run.workload.global_batch_size)
    t = Table(title=f"{run.model.name} on {counts['gpus']} x {hw.name}, global batch {run.workload.global_batch_size} "
                    f"x {run.model.seq_len} tokens, {run.workload.precision}: top {min(k, len(cands))} by predicted "
                    f"tokens/s\n{network(run)}", title_justify="left", header_style="bold")
    for col in ("#", "strategy", *(a.short for a in AXES), "ZeRO", "mb", "m", "ckpt", "step s", "tokens/s",
                "MFU %", "mem GiB", "across nodes", "family error", "why"):
        t.add_column(col, justify="left" if col in ("strategy", "ckpt", "why") else "right")
    for i, c in enumerate(cands[:k]):
        p = c.pred
        nxt = cands[i + 1] if i + 1 < len(cands) else None
        mfu = 100 * flops / p["step_time_s"] / counts["gpus"] / (peak * 1e12) if peak else float("nan")
        sched = c.schedule if c.pp > 1 else ""
        sp = (" +sp" if c.knobs.get("sequence_parallel") else "") + (" +bf16 params" if c.knobs.get("low_precision_params") else "")
        sp += f" hsdp {c.dp_replicate}x{c.dp // c.dp_replicate}" if c.dp_replicate > 1 else ""
        t.add_row(str(i + 1), c.strategy + (f" {sched}" if sched else "") + sp,
                  *(str(getattr(c, a.name)) for a in AXES), str(c.zero), str(c.mb), str(c.m), c.ckpt,
                  f"{p['step_time_s']:.3g}",
                  f"{p['tokens_per_s']:,.0f}", f"{mfu:.1f}", f"{p['peak_mem_bytes'] / 1024**3:.1f}/{gib:.0f}",
                  ", ".join(c.crosses) or "none", family_error(layout_family(c, rpn), hw.device, run.plan.memory_margin),
                  why(c, nxt, gib * 1024**3))
    return t


def family_error(fam: str, device: str, margin: bool) -> str:
    """The table's `family error` column: the family's tokens/s error and, where the planner applies it, its memory
    margin."""
    out = family_errors.short(fam, device)
    return out + (f"; memory +{100 * family_errors.memory_margin(fam, device):.0f} %" if margin and device != "cpu" else "")


def layout_family(c: Candidate, rpn: int) -> str:
    """The candidate's layout family (harness/dims.py family), the key of its validation error."""
    return family({"dp": c.dp, "tp": c.tp, "pp": c.pp, "ep": c.ep, "cp": c.cp}, rpn)


def unsure(cands: list[Candidate], run, gpus: int, running: int) -> str | None:
    """Where a layout the table shows (plan.top_k) or `--run-top K` would run (K: harness/costmodel/family_errors.json's)
    is of a family whose validation error is large (family_errors.LARGE_P90_PCT), the line that says so and
    recommends running the top K."""
    rt = family_errors.run_top()
    top = cands[:run.plan.top_k] + plan_check.distinct_layouts(cands, rt["k"], run.plan.run_top_by)
    rpn = ranks_per_node(Hardware.of(run.hardware), gpus, run.launcher.nodes)
    device = run.hardware.device
    fams = [f for f in dict.fromkeys(layout_family(c, rpn) for c in top) if family_errors.large(f, device)]
    if not fams:
        return None
    advice = ("" if running >= rt["k"] else
              f"; measure before you choose: --run-top {rt['k']} (with it, plan's top {rt['k']} held a layout within "
              f"{100 * plan_check.WITHIN:.0f} % of the measured best in {rt['groups_found']} of {rt['groups']} (model, node "
              f"count) groups of the Playbook sweep's development half; docs/playbook.md)")
    return (f"unsure: among the top layouts, {'; '.join(family_errors.short(f, device) for f in fams)} "
            f"{'is' if len(fams) == 1 else 'are'} over {family_errors.LARGE_P90_PCT:.0f} %, so the ranking may be "
            f"wrong{advice}")


def hints(run, gpus: int) -> list[str]:
    """What in the workload, not the layouts, decides the table: the defaults suit a few CPU ranks (global
    batch 8, fp32), so a GPU cluster's plan made with them ranks layouts nobody would run."""
    hw, w = run.hardware, run.workload
    out = [n for n in [catalog.fp32_on_gpu_note(hw.name, hw.device, hw.peak_tflops, w.precision)] if n]
    if w.global_batch_size < gpus:
        out.append(f"global batch {w.global_batch_size} sequences on {gpus} devices: dp x mb <= "
                   f"{w.global_batch_size}, so every layout has tp x pp >= {-(-gpus // w.global_batch_size)}; "
                   f"set workload.global_batch_size to the batch you train with")
    return out


def run_top(cands: list[Candidate], k: int, overrides: list[str], by: str = "degrees") -> int:
    """Run the best k distinct layouts as one brigade sweep (hydra.sweeper.runs), then print predicted
    vs measured rank and Spearman's rho (harness/tools/plan_check.py)."""
    def quoted(o: str) -> str:
        return "'" + o.replace("\\", "\\\\").replace("'", "\\'") + "'"

    launched = plan_check.distinct_layouts(cands, k, by)
    runs = "[" + ",".join("[" + ",".join(quoted(o) for o in c.overrides()) + "]" for c in launched) + "]"
    keep = [o for o in overrides if not o.startswith(("plan.", "strategy", "parallel.", "workload.micro_batch_size",
                                                       "workload.activation_checkpointing", "hydra.sweeper.runs"))]
    if not any(o.startswith("study=") for o in keep):
        keep.append(f"study=plan_{time.strftime('%Y%m%d_%H%M%S')}")
    argv = [sys.executable, "-m", "harness", "-m", *keep, f"hydra.sweeper.runs={runs}"]
    print("running: " + " ".join(argv[1:]), flush=True)
    repo = Path(__file__).resolve().parents[1]
    rc = subprocess.run(argv, cwd=repo, env=dict(os.environ)).returncode
    run = compose_run(keep)
    path = records_path(Path(repo, run.results_dir) if not Path(run.results_dir).is_absolute() else run.results_dir,
                        run.study)
    print(plan_check.report(plan_check.compare(launched, read(path) if path.exists() else [])), flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m harness.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="Hydra overrides: model=, hardware=, workload.*, plan.gpus=, plan.top_k=")
    p.add_argument("--run-top", type=int, default=None, help="run the best K as a brigade sweep (plan.run_top)")
    p.add_argument("--dryrun-top", type=int, default=0, help="confirm the memory of the best K by dry runs")
    args = p.parse_intermixed_args(argv)
    run = compose_run(args.overrides)
    gpus, k = run.plan.gpus, run.plan.top_k
    top = args.run_top if args.run_top is not None else run.plan.run_top
    cands, counts = search(run, gpus)
    counts["gpus"] = gpus
    console = Console(width=max(Console().width, 200))
    if cands:
        console.print(table(cands, k, run, counts))
    else:
        console.print(f"[yellow]no layout of {gpus} devices fits {run.model.name} in {run.hardware.memory_GiB} GiB "
                      f"with global batch {run.workload.global_batch_size}[/]")
    margin = (f" with their family's memory margin ({counts['over_margin']} more fit only without it: "
              f"plan.memory_margin=false ranks them)" if run.plan.memory_margin else "")
    console.print(f"{counts['evaluated']} evaluated: {len(cands)} fit in memory{margin}, "
                  f"{counts['over_memory'] - counts['over_margin']} over {run.hardware.memory_GiB:g} GiB; global batch "
                  f"{run.workload.global_batch_size} (workload.global_batch_size) fixes the micro-batch count "
                  f"m = global / (dp * mb)")
    if cands and (line := unsure(cands, run, gpus, top or 0)):
        console.print(f"[yellow]{line}[/]", soft_wrap=True)
    for line in hints(run, gpus):
        console.print(f"[yellow]note: {line}[/]")
    rc = 0
    if top and cands:
        rc = run_top(cands, top, args.overrides, run.plan.run_top_by)
    if args.dryrun_top and cands:
        install_signals()  # the dry runs run here: a SIGTERM or Ctrl-C ends them as `interrupted`, children and all
        rc |= dryrun_top(cands, args.dryrun_top, args.overrides, run.plan.run_top_by)
    n, s = counts["evaluated"], counts["seconds"]
    print(f"evaluated {n} configs in {s:.3f} s ({n / s if s else 0:.0f} configs/s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
