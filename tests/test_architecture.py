"""Guards on the shape of the code: they fail the moment a change brings back what the house rules
removed. They read source files with ast and import modules; one runs a ddp run and holds the README's
list of the files a run reads against the modules its processes hold."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import catalog
from harness.dims import DEGREES, MESH_AXES
from harness.run.record import Status
from harness.tools import import_floors
from harness.tools.import_floors import (
    EXCEPTIONS,
    FLOORS,
    MODULES,
    REPO,
    drawing,
    floor_of,
    import_graph,
    project_files,
    upward,
)

MAX_LINES = 500  # a smell detector, not a budget: a module is one idea, and files always read together merge


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["harness.catalog"] = graph["harness.catalog"] | {"harness.validate"}  # validate imports the catalog
    assert find_cycle(graph) is not None


def test_every_module_stands_on_a_floor_and_no_import_runs_back_up_one():
    """harness/tools/import_floors.py: each module on one floor; an import that runs back up a floor is
    written down in EXCEPTIONS with its reason, or this fails with the drawing."""
    graph = import_graph()
    for m in graph:
        floor_of(m)  # raises for a module on no floor
    undocumented = [a for a in upward(graph) if a not in EXCEPTIONS]
    assert not undocumented, drawing(graph)
    assert set(EXCEPTIONS) <= set(upward(graph)), "an exception that no longer happens: remove it"


def test_the_floor_check_sees_a_planted_arrow_back_up():
    graph = import_graph()
    graph["harness.catalog"] = graph["harness.catalog"] | {"harness.run.job"}
    assert ("harness.catalog", "harness.run.job") in upward(graph)
    assert "NOT DOCUMENTED" in drawing(graph)
    assert floor_of("harness.catalog") == 0 and floor_of("harness.run.job") == len(FLOORS) - 2


def test_catalog_rows_name_modules_that_exist():
    """A strategy or launcher is loaded by the module its catalog row names (no formatted names): each
    exists, and the launchers are the launcher= choices in conf/launcher/."""
    named = set().union(*import_floors.catalog_loads().values())
    assert named <= set(MODULES), sorted(named - set(MODULES))
    assert set(catalog.LAUNCHERS) == {p.stem for p in (REPO / "conf" / "launcher").glob("*.yaml")}


STATUS_VALUES = {s.value for s in Status}
# Literals spelled like a status that are not one, each with its reason.
NOT_A_STATUS = {("harness/config.py", "failed"): "rerun=failed: the option's value (which runs to run again)",
                ("harness/run/results_file.py", "failed"): "rerun=failed, compared where resume reads it",
                ("harness/run/cause.py", "timeout"): "coreutils `timeout`: the command's name (stop_cause)",
                ("lab/playbook.py", "ok"): "the Playbook sweep's own status column (ok | crashed_or_oom), read once (RAN)"}


def status_literals(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in STATUS_VALUES]


def test_no_raw_status_string_outside_the_enum():
    """A run's status is written and compared as harness.run.record.Status, the one list of them: a string
    spelled like one elsewhere is a fact restated (or, where it is not a status, written down above)."""
    found = [f"{rel}:{line}: {value!r}" for p in project_files() if (rel := str(p.relative_to(REPO))) !=
             "harness/run/record.py" for line, value in status_literals(p) if (rel, value) not in NOT_A_STATUS]
    assert not found, "\n".join(found)


def test_status_check_sees_a_planted_literal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('if r["status"] == "timeout":\n    pass\n')
    assert status_literals(planted) == [(1, "timeout")]


AXIS_HOMES = ("harness/dims.py", "harness/catalog.py")  # the enumeration, and each strategy's axes as data


def axis_lists(path: Path) -> list[int]:
    """Lines with a tuple, list or set literal naming two axes or more: a restated axis list."""
    axes = set(DEGREES)
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Tuple, ast.List, ast.Set))
            and sum(isinstance(e, ast.Constant) and e.value in axes for e in n.elts) >= 2]


def test_no_restated_axis_list():
    """Axes, world size and placement come from harness/dims.py (AXES, DEGREES, PLACEMENT, world_size,
    ParallelDims); a literal list of axes elsewhere drifts from it (a planner table without cp)."""
    found = [f"{rel}:{line}" for p in project_files() if (rel := str(p.relative_to(REPO))) not in AXIS_HOMES
             for line in axis_lists(p)]
    assert not found, "\n".join(found)


def test_axis_list_check_sees_a_planted_list(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('for axis in ("dp", "tp", "pp"):\n    pass\nx = ["dp"]\n')
    assert axis_lists(planted) == [1]


# Names that are also mesh-axis names (tp, pp, ep) name axes far more often than strategies.
NAMES = (set(catalog.STRATEGIES) | set(catalog.SCHEDULES)) - set(MESH_AXES)
ALLOWED = ("harness/catalog.py", "harness/strategies/")


def name_literals(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES]


def test_strategy_and_schedule_names_live_in_the_catalog():
    """A strategy or schedule name as a string literal outside conf/, the catalog, strategies/ (name ->
    torch class) and tests/ is a fact restated: read the catalog instead."""
    found = [f"{p.relative_to(REPO)}:{line}: {value!r}" for p in project_files()
             if not str(p.relative_to(REPO)).startswith(ALLOWED) for line, value in name_literals(p)]
    assert not found, "\n".join(found)


def test_name_literal_check_sees_a_planted_literal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('if schedule == "dualpipev":\n    pass\n')
    assert name_literals(planted) == [(1, "dualpipev")]


PARENT_SIDE = ("harness.run.job", "harness.run.sweep", "harness.run.record", "harness.run.ending", "harness.run.claims",
               "harness.run.cause", "harness.run.signals", "harness.run.terminal",
               "harness.costmodel", "harness.plan", "harness.predict", "harness.report",
               "harness.catalog", "harness.validate", "harness.collect.aggregate", "harness.collect.aggregate",
               "launch.local", "hydra_plugins.brigade_sweeper")


def test_parent_side_imports_without_torch():
    """The parent process, the cost model, the planner and the report never need torch: they import
    in a process where `import torch` raises."""
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is not allowed on the parent side')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import importlib\n"
            f"for m in {PARENT_SIDE!r}:\n"
            "    importlib.import_module(m)\n"
            "assert not any(k == 'torch' or k.startswith('torch.') for k in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("path", project_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(REPO)} has {n} lines (> {MAX_LINES}): does it hold more than one idea?"


COSTMODEL = "harness/costmodel/"


def readme_run_files() -> tuple[list[str], list[str]]:
    """The README's list of the files one run reads outside the cost model, in the order it meets them,
    and the cost model's files (each between its markers)."""
    text = (REPO / "README.md").read_text()
    section = text.split("<!-- run-files:start -->")[1].split("<!-- run-files:end -->")[0]
    listed = [line.split("`")[1] for line in section.splitlines() if line[:1].isdigit() and line.count("`") >= 2]
    costmodel = text.split("<!-- costmodel-files:start -->")[1].split("<!-- costmodel-files:end -->")[0]
    return listed, [COSTMODEL + name for name in costmodel.split("`")[1::2]]


def held_project_files(log_dir: Path) -> set[str]:
    """Project files whose modules any process of a run held in sys.modules at its exit."""
    names = {m for f in log_dir.glob("*.txt") for m in f.read_text().split()}
    return {str(MODULES[n].relative_to(REPO)) for n in names if n in MODULES}


@pytest.mark.slow
def test_a_ddp_run_reads_the_files_the_readme_lists(tmp_path):
    """One ddp run, parent and ranks together, holds in sys.modules exactly the project files the README
    lists, and the cost model's files it names apart (tests/inject/sitecustomize.py writes each process's
    sys.modules as it exits, the ranks' os._exit included); the README's counts are these lists'."""
    from tests.helpers import cli

    log = tmp_path / "imports"
    log.mkdir()
    inject = str(REPO / "tests" / "inject")
    proc = cli(["strategy=ddp", "parallel.dp=2", "model=tiny"], tmp_path,
               env={"BRIGADE_TEST_IMPORT_LOG": str(log),
                    "PYTHONPATH": os.pathsep.join(p for p in (inject, os.environ.get("PYTHONPATH")) if p)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(list(log.glob("*.txt"))) >= 4  # the parent, torchrun and two ranks each wrote theirs
    held = held_project_files(log)
    listed, costmodel = readme_run_files()
    assert len(listed) == len(set(listed)) and len(costmodel) == len(set(costmodel)), (listed, costmodel)
    run_files = {f for f in held if not f.startswith(COSTMODEL)}
    assert set(listed) == run_files, (f"README lists but the run does not hold: {sorted(set(listed) - run_files)}; "
                                      f"held but not listed: {sorted(run_files - set(listed))}")
    assert set(costmodel) == held - run_files, sorted(set(costmodel) ^ (held - run_files))
    text = (REPO / "README.md").read_text()
    assert f"reads these\n{len(listed)} files" in text and f"the cost model's {len(costmodel)} besides" in text


def test_the_readme_lists_parse():
    listed, costmodel = readme_run_files()
    assert "harness/run/job.py" in listed and "harness/costmodel/__init__.py" in costmodel
    assert all((REPO / f).exists() for f in listed + costmodel), [f for f in listed + costmodel
                                                                   if not (REPO / f).exists()]


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


# The one private module allowed: the sweeper extends Hydra's BasicSweeper, the usual way to write a sweeper.
SWEEPER_BASE = "hydra._internal.core_plugins.basic_sweeper"
PRIVATE_HYDRA = SWEEPER_BASE.split(".core_plugins")[0]  # Hydra's private package: it can change in any release


def test_no_private_hydra_api_beyond_the_sweepers_base_class():
    """Only the sweeper imports from Hydra's private package, and only its base class."""
    allowed = {REPO / "hydra_plugins/brigade_sweeper/study_sweeper.py": {SWEEPER_BASE}}
    found = [f"{p.relative_to(REPO)}: {m}" for p in project_files() for m in sorted(imported_modules(p))
             if m.startswith(PRIVATE_HYDRA) and m not in allowed.get(p, set())]
    assert not found, "\n".join(found)


# Modules that write files into a run directory (harness/rundir.py lists the files).
RUN_DIR_WRITERS = ("harness/worker", "harness/strategies", "harness/run", "harness/collect", "launch")


def whole_file_writes(path: Path) -> list[int]:
    """Lines that write a whole file other than by rundir.write_atomic: write_text, write_bytes,
    json.dump, torch.save to anything but an in-memory buffer, open(..., "w") of anything but a log
    (workers.log is a stream, appended as the ranks print)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f, args = node.func, [ast.unparse(a) for a in node.args]
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
        mode = next((k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)),
                    node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "")
        if (name in ("write_text", "write_bytes") or (owner, name) == ("json", "dump")
                or ((owner, name) == ("torch", "save") and args[1:2] != ["buf"])
                or (name == "open" and "w" in str(mode) and "log" not in args[0])):
            out.append(node.lineno)
    return out


def test_run_dir_files_are_written_whole_and_synced_by_one_helper():
    found = [f"{p.relative_to(REPO)}:{line}" for p in project_files()
             if str(p.relative_to(REPO)).startswith(RUN_DIR_WRITERS) for line in whole_file_writes(p)]
    assert not found, "write these through harness.rundir.write_atomic:\n" + "\n".join(found)


def test_whole_file_write_check_sees_a_planted_write(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('from pathlib import Path\nPath("progress").write_text("1 2")\nopen("x", "w")\n'
                       'open(log_path, "w")\ntorch.save(g, buf)\ntorch.save(g, path)\n')
    assert whole_file_writes(planted) == [2, 3, 6]


def test_the_product_does_not_import_the_lab():
    """lab/ (the published-validation machinery) sits beside the product: it reads the cost model, and
    nothing under harness/, models/, launch/ or hydra_plugins/ reads it."""
    graph = import_graph()
    found = [f"{m} -> {d}" for m, deps in graph.items() if not m.startswith("lab") for d in deps
             if d.startswith("lab")]
    assert not found, "\n".join(found)
