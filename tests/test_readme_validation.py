"""docs/validation.md is what `python -m lab.published_doc` writes, and its split is honest.

Pure tier (no torch): one pass of the cost model over lab/published_runs.yaml, plus the rows whose
profile a post-hoc constant sits on, predicted again with it neutral.
"""
from __future__ import annotations

from lab import published, published_doc


def test_validation_doc_is_generated():
    assert published_doc.DOC.read_text() == published_doc.validation_doc(), \
        "docs/validation.md is stale: python -m lab.published_doc"


def test_a_source_seen_before_a_decision_is_in_the_fitting_half():
    """Every post-hoc decision names what was seen and the sources it was taken on, all in the fitting half;
    a decision that is one constant names its profiles and neutral value."""
    decisions = published_doc.post_hoc()
    assert {c["constant"] for c in published_doc.post_hoc_constants()} >= {"compute.clock_scale",
                                                                           "compute.allocator_overhead"}
    _, rows = published.load()
    half = {r["source"]: r["half"] for r in rows}
    for d in decisions:
        assert d["decision"] and d["seen"] and d["chosen_on"], d
        assert all(half[s] == "fitting" for s in d["chosen_on"]), d
        if "constant" in d:
            assert d["profiles"] and "neutral" in d, d


def test_neutral_constants_touch_only_their_profiles_and_change_the_prediction():
    constants = published_doc.post_hoc_constants()
    models, rows = published.load()
    row = next(r for r in rows if r["source"] == "torchtitan_h100")
    elsewhere = {**row, "hardware": "h200"}  # a profile no post-hoc constant lists
    assert published_doc.neutral_row(elsewhere, constants) is elsewhere
    neutral = published_doc.neutral_row(row, constants)
    assert neutral["hardware_overrides"] == {c["constant"]: c["neutral"] for c in constants
                                             if row["hardware"] in c["profiles"]}
    assert {"compute.clock_scale", "compute.allocator_overhead"} <= set(neutral["hardware_overrides"])
    compose = published.caching_compose()
    as_is, off = (published.predict_row(r, models[r["model"]], compose) for r in (row, neutral))
    # clock_scale 0.903 -> 1: faster GEMMs; allocator_overhead 0.199 -> 0: no allocator term
    assert off["predicted_tokens_per_s_per_gpu"] > as_is["predicted_tokens_per_s_per_gpu"]
    assert off["predicted_allocator_GiB"] == 0 < as_is["predicted_allocator_GiB"]
    assert off["predicted_tensors_GiB"] == as_is["predicted_tensors_GiB"]
