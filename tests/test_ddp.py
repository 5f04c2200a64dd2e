"""Multi-process tier: DDP on 2 gloo processes matches the single-process reference."""
from __future__ import annotations

import pytest

from tests.helpers import assert_losses_match, assert_states_as_predicted, run

pytestmark = pytest.mark.slow


def test_ddp_matches_single(tmp_path, single_reference):
    ref = single_reference()
    rec = run(["strategy=ddp", "parallel.dp=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert_losses_match(rec["measured"]["losses"], ref["measured"]["losses"])
    # DDP replicates: every rank holds exactly what the single process holds
    assert rec["measured"]["model_states_bytes_per_rank"] == [ref["measured"]["model_states_bytes"]] * 2
    assert_states_as_predicted(rec)
    assert_states_as_predicted(ref)
    assert rec["dims"] == {"dp": 2, "tp": 1, "pp": 1, "vpp": 1, "ep": 1, "world_size": 2, "cp": 1, "dp_replicate": 1}


def test_model_state_bytes_are_exact(single_reference):
    ref = single_reference()
    m = ref["measured"]
    # tiny: 4 layers x (4h^2 + 2h*4h + 4h) + 2*V*h + s*h + 2h, fp32; AdamW holds 2 fp32 moments + a step counter
    h, L, V, s = 128, 4, 1024, 64
    n = L * (4 * h * h + 2 * h * 4 * h + 4 * h) + 2 * V * h + s * h + 2 * h
    assert m["params_bytes"] == 4 * n
    assert m["grads_bytes"] == 4 * n
    n_tensors = len([1 for _ in range(L * 10 + 5)])  # per block: ln1 w,b, q,k,v,o, ln2 w,b, fc1, fc2; + tok,pos,ln_f w,b,head
    assert m["optimizer_bytes"] == 8 * n + 4 * n_tensors  # exp_avg + exp_avg_sq + a 0-d fp32 step per param
