"""docs/validation.md, written by `python -m lab.published_doc` (never by hand).

The page states the rule that keeps the held-out half out of sight, the halves, every decision taken after
held-out rows were seen (lab/published_runs.yaml `post_hoc`), and the fitting half's figures: summary, by
source, every row. The sources first held out and moved by a post-hoc decision are summarised apart, as the
model stands and with each post-hoc constant at its neutral value. The page predicts no held-out row: a
held-out row's figures are printed only at a look (`python -m lab.published --half held_out`), and each
look is logged in docs/heldout_log.md. tests/test_readme_validation.py checks that the committed page is
what this module writes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lab import published
from lab.published_memory import summarise_memory

DOC = Path(__file__).resolve().parents[1] / "docs" / "validation.md"


def post_hoc(path: Path = published.DATA) -> list[dict]:
    """lab/published_runs.yaml's `post_hoc` list: each decision taken after held-out rows were seen, what was
    seen, the sources it was taken on and, for one constant, the constant, its profiles and neutral value."""
    return yaml.safe_load(path.read_text()).get("post_hoc", [])


def post_hoc_constants(path: Path = published.DATA) -> list[dict]:
    """The post-hoc decisions that are one constant with a neutral value."""
    return [d for d in post_hoc(path) if "constant" in d]


def neutral_row(row: dict, constants: list[dict]) -> dict:
    """The row with every post-hoc constant of its profile at its neutral value."""
    neutral = {c["constant"]: c["neutral"] for c in constants if row["hardware"] in c["profiles"]}
    return {**row, "hardware_overrides": {**row.get("hardware_overrides", {}), **neutral}} if neutral else row


def predict_all(constants: list[dict]) -> tuple[list[dict], list[dict]]:
    """The fitting half's (results as published, results with the post-hoc constants neutral), row for row."""
    models, rows = published.load()
    compose = published.caching_compose()
    as_is, neutral = [], []
    for row in rows:
        if row["half"] != "fitting":  # kept out of sight: predicted only at a look
            continue
        as_is.append(published.predict_row(row, models[row["model"]], compose))
        off = neutral_row(row, constants)  # the same row where no post-hoc constant sits on its profile
        neutral.append(as_is[-1] if off is row else published.predict_row(off, models[row["model"]], compose))
    return as_is, neutral


def _summary_cells(rs: list[dict]) -> str:
    s = published.summarise(rs)
    mem = summarise_memory(rs)
    memory = (f"{mem['median_abs_err_pct']:.1f} / {mem['p90_abs_err_pct']:.1f} % ({mem['n']})" if mem
              else "none published")
    return (f"{s['n']} | {s['median_abs_err_pct']:.1f} / {s['p90_abs_err_pct']:.1f} % | {s['geomean_ratio']:.3f} | "
            f"{s['within_15_pct']} | {s['worst_err_pct']:+.1f} % ({s['worst']}) | {s['predicted_oom']} | {memory}")


RULE = [
    "## The rule",
    "",
    "- The split is by source, made when a source is added, before any of its rows is predicted.",
    "- A held-out row is kept out of sight. This page and `python -m lab.published` predict the fitting half "
    "only; a held-out row is predicted only by `python -m lab.published --half held_out`, a look, and every "
    "look is logged in [heldout_log.md](heldout_log.md) with what was on screen and what was decided after it. "
    "No test asserts a property of a held-out row's prediction: tests predict the fitting half, and check a "
    "held-out row only for its mapping into a config (its citation, its half, its overrides).",
    "- What moves a source: a decision that changes its rows' predictions (a constant chosen, a mechanism kept, "
    "reverted or looked for, a row's mapping changed, a test that holds the model to a property of its rows), "
    "taken after any of its rows' predictions were seen. The source moves to the fitting half, and `post_hoc` in "
    "lab/published_runs.yaml records the decision, what was seen and the sources; where the decision is one "
    "constant, its neutral value lets this page show the moved sources without it.",
    "- A look after which nothing is decided moves nothing.",
    "",
]


def render(as_is: list[dict], neutral: list[dict], decisions: list[dict], held_out: dict[str, int]) -> str:
    moved = list(dict.fromkeys(src for d in decisions for src in d["chosen_on"]))
    sources = list(dict.fromkeys(r["source"] for r in as_is))
    held = (", ".join(f"`{s}` ({n} rows)" for s, n in held_out.items()) if held_out
            else "none: every source first held out was seen before a decision (below)")
    head = ("| group | rows | throughput median / p90 abs. error | geomean ratio | within 15 % | worst | "
            "predicted OOM | memory median / p90 abs. error (rows) |")
    rule = "|---|--:|---|--:|--:|---|--:|---|"
    first_split = [r for r in as_is if r["source"] in moved]
    out = [
        "# Validation against published GPU runs",
        "",
        "<!-- generated by python -m lab.published_doc; do not edit -->",
        "",
        f"The cost model predicts {len(as_is)} published, measured GPU training runs of the fitting half "
        "(`lab/published_runs.yaml`, each row cited there; how each source maps into brigade: "
        "[published.md](published.md)). Error = predicted / published - 1, throughput in tokens/s per GPU; memory "
        "where a source publishes it. Predicted OOM counts runs that ran but are predicted not to fit.",
        "",
        *RULE,
        "## The halves",
        "",
        "- **fitting**: " + ", ".join(f"`{s}`" for s in sources),
        f"- **held_out**: {held}",
        "",
        "## Decisions taken after held-out rows were seen",
        "",
        "`post_hoc` in lab/published_runs.yaml; each source named moved to the fitting half "
        "(the looks themselves: [heldout_log.md](heldout_log.md)).",
        "",
        "| decision | seen | sources | constant (profiles) | neutral value |",
        "|---|---|---|---|--:|",
        *(f"| {d['decision']} | {d['seen']} | {', '.join(f'`{s}`' for s in d['chosen_on'])} | "
          + (f"`{d['constant']}` ({', '.join(f'`{p}`' for p in d['profiles'])}) | {d['neutral']} |" if "constant" in d
             else "none | |") for d in decisions),
        "",
        "## Summary",
        "",
        head, rule,
        *(f"| {name} | {_summary_cells(rs)} |" for name, rs in (
            ("fitting", as_is), ("fitting, post-hoc constants neutral", neutral), ("the moved sources", first_split),
            ("the moved sources, post-hoc constants neutral",
             [n for r, n in zip(as_is, neutral) if r["source"] in moved])) if rs),
        "",
        "The moved sources are those first held out (the rows that would be held out had nothing been decided "
        "after seeing them); their figures are no held-out result.",
        "",
        "## By source",
        "",
        head, rule,
        *(f"| `{s}`{' (moved)' if s in moved else ''} | {_summary_cells([r for r in as_is if r['source'] == s])} |"
          for s in sources),
        *(f"| `{s}`, post-hoc constants neutral | {_summary_cells([n for n in neutral if n['source'] == s])} |"
          for s in sources if s in moved),
        "",
        "## Every row",
        "",
        "| source | # | model | layout | published tokens/s/GPU | predicted | ratio | post-hoc neutral |",
        "|---|--:|---|---|--:|--:|--:|--:|",
        *(f"| `{r['source']}` | {r['index']} | {r['model']} | {r['layout']} | "
          f"{r['published_tokens_per_s_per_gpu']:.0f} | {r['predicted_tokens_per_s_per_gpu']:.0f} | {r['ratio']:.3f} | "
          f"{n['ratio']:.3f} |" for r, n in zip(as_is, neutral)),
        "",
    ]
    mem = [(r, n) for r, n in zip(as_is, neutral) if "mem_ratio" in r]
    if mem:
        out += ["Memory (GiB per GPU; predicted = the tensors' peak + the allocator term, "
                "lab/published_memory.py):",
                "",
                "| source | # | metric | published | predicted | ratio | post-hoc neutral: predicted | ratio |",
                "|---|--:|---|--:|--:|--:|--:|--:|",
                *(f"| `{r['source']}` | {r['index']} | {r['memory_metric']} | {r['published_mem_GiB']:.1f} | "
                  f"{r['predicted_mem_GiB']:.1f} | {r['mem_ratio']:.3f} | {n['predicted_mem_GiB']:.1f} | "
                  f"{n['mem_ratio']:.3f} |"
                  for r, n in mem), ""]
    return "\n".join(out)


def held_out_sources() -> dict[str, int]:
    """{held-out source: its row count}: what the page may say of the held-out half."""
    _, rows = published.load()
    out: dict[str, int] = {}
    for r in rows:
        if r["half"] == "held_out":
            out[r["source"]] = out.get(r["source"], 0) + 1
    return out


def validation_doc() -> str:
    return render(*predict_all(post_hoc_constants()), post_hoc(), held_out_sources())


def write(path: Path = DOC) -> Path:
    path.write_text(validation_doc())
    return path


def main() -> int:
    print(f"wrote {write()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
