"""`python -m harness.predict <hydra overrides>`: the cost model's prediction for one config: a short
summary (time, throughput, memory, communication, bubble), or with `--json` one JSON object on stdout
(every predicted key at the top level, plus `dims` and `config`; results/README.md says what each
is). No torch is imported and nothing is launched, so it answers for any degrees (parallel.dp=1024,
hardware=h100_sxm) on any machine.

    python -m harness.predict model=gpt_7b hardware=h100_sxm strategy=ddp parallel.dp=64 \\
        workload.global_batch_size=128 workload.micro_batch_size=1 workload.precision=bf16-mixed [--json]

A config that cannot run prints why (the arithmetic; with --json {"status": "invalid", "error": ...})
and exits 2. One the cost model prices but brigade's runtime does not run (Megatron-LM's layouts the
published set predicts: DDP x TP, Megatron-Core's overlaps, bf16 params under DDP) is predicted, with
`not_run` saying why brigade would refuse to launch it.
"""
from __future__ import annotations

import json
import sys

from harness.catalog import fp32_on_gpu_note
from harness.config import as_dict, compose_run
from harness.costmodel import family_errors, predict
from harness.costmodel.inputs import Hardware, ranks_per_node
from harness.costmodel.memory_peak import TERMS
from harness.dims import COMM_AXES, ConfigError, family
from harness.labels import base_label, nbytes
from harness.run.record import Status
from harness.validate import validate


def predict_overrides(overrides: list[str]) -> dict:
    run = compose_run(overrides)
    config = as_dict(run)
    not_run = {}
    try:
        try:
            dims = validate(run)
        except ConfigError as e:  # a layout only brigade's runtime refuses (Megatron's, as the published set has them)
            dims, not_run = validate(run, torch_runs=False), {"not_run": str(e)}
        out = predict(run, dims)
    except ConfigError as e:
        return {"status": Status.INVALID, "error": str(e), "config": config}
    fam = family(dims.as_dict(), ranks_per_node(Hardware.of(run.hardware), dims.world_size, run.launcher.nodes))
    return {"status": Status.OK, **out, **not_run, "family": fam,
            "family_error": family_errors.of(fam, run.hardware.device), "dims": dims.as_dict(), "config": config}


def summary(out: dict) -> str:
    """The figures a reader looks at first, one per line (the rest: --json)."""
    if out["status"] != Status.OK:
        return f"invalid: {out['error']}"
    c = out["config"]
    lines = [f"{base_label({'config': c, 'dims': out['dims']})}: {c['model']['name']} on "
             f"{out['dims']['world_size']} x {c['hardware']['name']}, global batch {c['workload']['global_batch_size']}, "
             f"{c['workload']['precision']}",
             f"  step time      {out['step_time_s']:.4g} s  (compute {out['compute_time_s']:.4g} s, exposed comm "
             f"{out.get('comm_exposed_time_s', 0):.4g} s, bubble {out.get('bubble_time_s', 0):.4g} s)",
             f"  throughput     {out['tokens_per_s']:.4g} tokens/s, {out['tokens_per_s_per_device']:.4g} per device, "
             f"MFU {out['mfu_pct']:.1f} %",
             f"  how sure       {family_errors.line(out['family'], c['hardware']['device'])}",
             f"  memory/device  model states {nbytes(out['model_states_bytes'])}, activations at their most "
             f"{nbytes(out['activations_bytes'])}, peak {nbytes(out['peak_mem_bytes'])}"
             + ("" if out.get("fits_in_memory", True) else "  (does NOT fit)"),
             *peak_lines(out),
             "  comm/step      " + (", ".join(f"{a} {nbytes(out[f'comm_{a}_bytes'])}" for a in COMM_AXES
                                             if out.get(f"comm_{a}_bytes")) or "none")
             + f"; {out.get('comm_share_pct', 0):.1f} % of the step",
             *([f"  not run        brigade's runtime refuses it, the cost model prices it: {out['not_run']}"]
               if "not_run" in out else []),
             *([f"  note           {note}"] if (note := fp32_on_gpu_note(
                 c["hardware"]["name"], c["hardware"]["device"], c["hardware"]["peak_tflops"], c["workload"]["precision"]))
               else []),
             "all figures: --json (names and units: results/README.md)"]
    return "\n".join(lines)


def peak_lines(out: dict) -> list[str]:
    """The predicted peak as its terms (harness/costmodel/memory_peak.py TERMS), whole bytes that add up
    to it, on the rank and at the phase where it falls."""
    pp = out["dims"]["pp"]
    where = f"pp rank {out['peak_mem_pp_rank']} of {pp}" if pp > 1 else "the busiest rank"
    lines = [f"  peak, by term  on {where}, at {'the loss' if out['peak_mem_phase'] == 'loss' else 'the end of backward'}:"]
    lines += [f"    {b / 2**30:>9.3f} GiB {b:>19,} B  {TERMS[k]}" for k, b in out["peak_mem_terms"].items()]
    total = out["peak_mem_bytes"]
    return [*lines, f"    {total / 2**30:>9.3f} GiB {total:>19,} B  = peak"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    as_json = "--json" in argv
    out = predict_overrides([a for a in argv if a != "--json"])
    print(json.dumps(out, default=str) if as_json else summary(out))
    return 0 if out["status"] == Status.OK else 2


if __name__ == "__main__":
    sys.exit(main())
