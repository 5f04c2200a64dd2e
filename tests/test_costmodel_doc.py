"""docs/costmodel.md states the GPU profiles' constants as the profiles hold them: each value the doc's tables
give for a named profile is read back from that profile (conf/hardware/, composed as a run composes it)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from harness.config import compose_run

DOC = Path(__file__).resolve().parents[1] / "docs" / "costmodel.md"
# how the doc names a profile in its value cells
NAMES = {"A100": ["a100_80g"], "H100": ["h100_sxm"], "H200": ["h200"], "96 GB H100": ["h100_hbm2e_96g"],
         "H100/H200": ["h100_sxm", "h200"], "H100 SXM, H200": ["h100_sxm", "h200"]}
# (the row's first cell as the doc writes it, the profile field it states; a value cell of "<name> <value>, ..."
# pairs, or one value for the profiles named in the first cell)
ROWS = [
    ("`memory_bw_GBps`", "memory_bw_GBps"),
    ("`intra_node.bus_bw_GBps`", "intra_node.bus_bw_GBps"),
    ("`inter_node.bus_bw_GBps`", "inter_node.bus_bw_GBps"),
    ("`memory_GiB`", "memory_GiB"),
    ("`inter_node.nics_per_node`", "inter_node.nics_per_node"),
    ("`compute.gemm.bf16.max_tflops`, A100", "compute.gemm.bf16.max_tflops"),
    ("`compute.clock_scale`, `h100_hbm2e_96g`", "compute.clock_scale"),
    ("`compute.allocator_overhead`, `h100_hbm2e_96g`", "compute.allocator_overhead"),
    ("`compute.overlap_slowdown`, every GPU profile", "compute.overlap_slowdown"),
    ("`attention_efficiency`, A100", "compute.attention_efficiency.bf16"),
    ("`attention_efficiency` / backward, H100 SXM, H200", "compute.attention_efficiency.bf16"),
]
GPU_PROFILES = ("a100_80g", "h100_sxm", "h200", "h100_hbm2e_96g")


def _profile(name: str) -> dict:
    return dataclasses.asdict(compose_run([f"hardware={name}"]).hardware)


def _field(profile: dict, dotted: str):
    value = profile
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _cells(first: str) -> list[str]:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| {first} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def _stated(first: str) -> dict[str, float]:
    """{profile: the value the doc gives it} for one row."""
    value = _cells(first)[1]
    pairs = re.findall(r"((?:96 GB )?[AH]\d00(?:/H200)?) ([\d.]+)", value)
    if pairs:
        return {p: float(v) for name, v in pairs for p in NAMES[name]}
    number = float(re.match(r"[\d.]+", value).group())
    named = [p for name, profiles in NAMES.items() if f", {name}" in first for p in profiles]
    named += [p for p in GPU_PROFILES if f"`{p}`" in first]
    return {p: number for p in (named or GPU_PROFILES)}


@pytest.mark.parametrize("first,field", ROWS, ids=[r[0] for r in ROWS])
def test_the_doc_states_each_constant_as_its_profile_holds_it(first, field):
    stated = _stated(first)
    assert stated
    for profile, value in stated.items():
        assert _field(_profile(profile), field) == pytest.approx(value, abs=5e-4), (profile, field)
