"""Hooks around the timed loop for measurements that must not distort the timings.

A hook has before_step(step), after_step(step) (cheap: they run inside the loop, outside the timed
region) and finish(strategy, batch, steps_done) -> dict merged into the rank's result (runs after the
timed steps, e.g. a profiled window). Measurement features register here, not in the loop.
"""
from __future__ import annotations


def make_hooks(run, dims, run_dir, strategy=None) -> list:
    from harness.worker import grad_dump

    hooks = []
    if grad_dump.grad_dump_enabled():  # the parity tests' gradient dump (before the first optimizer step)
        hooks.append(grad_dump.GradDump(strategy, run_dir))
    if run.workload.profile_steps > 0:
        from harness.worker.profiling import ProfiledWindow

        hooks.append(ProfiledWindow(run, dims, run_dir))  # A/B and profiled steps, after the timed ones
    return hooks
