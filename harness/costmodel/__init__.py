"""The cost model: analytic predictions for a config. Pure Python: it imports no torch."""
from harness.costmodel.flops import model_flops_per_step  # noqa: F401


def predict(run, dims) -> dict:
    """Predicted figures for one config, under the same names as the measured ones."""
    return {"model_flops_per_step": model_flops_per_step(run.model, run.workload.global_batch_size)}
