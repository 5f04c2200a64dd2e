"""docs/validation.md is what `python -m lab.published_doc` writes, and its split is honest.

Pure tier (no torch): one pass of the cost model over lab/published_runs.yaml, plus the rows whose
profile a post-hoc constant sits on, predicted again with it neutral.
"""
from __future__ import annotations

from lab import published, published_doc


def test_validation_doc_is_generated():
    assert published_doc.DOC.read_text() == published_doc.validation_doc(), \
        "docs/validation.md is stale: python -m lab.published_doc"


def test_a_source_a_constant_was_chosen_on_is_in_the_fitting_half():
    constants = published_doc.post_hoc_constants()
    assert {c["constant"] for c in constants} >= {"compute.clock_scale", "compute.allocator_overhead"}
    _, rows = published.load()
    half = {r["source"]: r["half"] for r in rows}
    for c in constants:
        assert c["chosen_on"] and all(half[s] == "fitting" for s in c["chosen_on"]), c


def test_neutral_constants_touch_only_their_profile_and_change_its_prediction():
    constants = published_doc.post_hoc_constants()
    models, rows = published.load()
    row = next(r for r in rows if r["source"] == "torchtitan_h100")
    other = next(r for r in rows if r["hardware"] != row["hardware"])
    assert published_doc.neutral_row(other, constants) is other
    neutral = published_doc.neutral_row(row, constants)
    assert neutral["hardware_overrides"] == {"compute.clock_scale": 1.0, "compute.allocator_overhead": 0.0}
    compose = published.caching_compose()
    as_is, off = (published.predict_row(r, models[r["model"]], compose) for r in (row, neutral))
    # clock_scale 0.903 -> 1: faster GEMMs; allocator_overhead 0.199 -> 0: no allocator term
    assert off["predicted_tokens_per_s_per_gpu"] > as_is["predicted_tokens_per_s_per_gpu"]
    assert off["predicted_allocator_GiB"] == 0 < as_is["predicted_allocator_GiB"]
    assert off["predicted_tensors_GiB"] == as_is["predicted_tensors_GiB"]
