"""The import graph of brigade's own modules, drawn by floors: `python -m harness.tools.import_floors`.

A floor is a set of modules that may import each other and anything below, never above. From the
ground up: facts every side reads, the config's schema, the pure parent side (cost model, validation,
the record and its files), the model, the strategies, what a rank runs, the launchers, the report, the
parent's job and sweep, and the commands. An import that runs back up a floor is a module reaching
for something built on top of it; each one that remains is written down in EXCEPTIONS with its reason,
and tests/test_architecture.py fails on any other. The drawing prints each floor with its modules,
how many arrows leave it for each floor below, and the arrows back up (the documented exceptions).

Imports are read from the source (ast), at any depth of a file (function-level imports too), so a lazy
import counts as much as one at the top; the modules loaded by a catalog row (harness/catalog.py: each
strategy's module, each launcher's) are arrows from the module that loads them.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "models", "launch", "hydra_plugins", "lab")

# Bottom to top: (floor, the modules on it). "a.b" names one module (a package: its __init__), "a.b." every
# module under a.b; the longest match decides.
FLOORS = (
    ("ground", ("harness", "harness.catalog", "harness.dims", "harness.rundir", "harness.run", "harness.run.signals",
                "harness.collect", "harness.collect.compute_classes", "harness.collect.dryrun", "models",
                "models.pipeline_split", "models.tp_plan", "launch", "launch.fork", "launch.fork_server",
                "harness.tools", "hydra_plugins")),
    ("schema", ("harness.config",)),
    ("pure parent side", ("harness.costmodel", "harness.costmodel.", "harness.validate", "harness.labels",
                          "harness.collect.aggregate", "harness.collect.trace_analysis", "harness.run.record",
                          "harness.collect.environment", "harness.run.results_file", "harness.run.claims",
                          "harness.run.wandb_log", "harness.run.cause", "harness.run.terminal")),
    ("model", ("models.layers", "models.moe", "models.gpt")),
    ("strategies", ("harness.strategies", "harness.strategies.")),
    ("rank", ("harness.worker.",)),
    ("launchers", ("launch.local", "launch.slurm", "launch.dryrun")),
    ("report", ("harness.report", "harness.report.", "harness.compare")),
    ("parent", ("harness.run.job", "harness.run.ending", "harness.run.sweep", "harness.run.invocation",
                "hydra_plugins.brigade_slurm", "hydra_plugins.brigade_sweeper", "hydra_plugins.brigade_sweeper.")),
    ("commands", ("harness.__main__", "harness.plan", "harness.predict", "harness.fidelity", "harness.calibrate",
                  "harness.trace", "harness.results", "harness.tools.", "lab", "lab.")),
)

# Arrows back up a floor that stay, each with its reason: (importer, imported) -> why.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in project_files()}


def _resolve(name: str) -> str | None:
    """The project module an import names (a module, or the package holding the imported name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports, at any depth of the file (function-level imports too)."""
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        deps = set()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for t in targets:
                r = _resolve(t)
                if r and r != mod and not mod.startswith(r + "."):  # a module importing its own package is not a cycle
                    deps.add(r)
        graph[mod] = deps
    for loader, loaded in catalog_loads().items():
        graph[loader] |= loaded
    return graph


def catalog_loads() -> dict[str, set[str]]:
    """The modules importlib loads by a catalog row's name: strategies (harness/strategies/__init__.py)
    and launchers (harness/run/job.py)."""
    from harness import catalog

    strategies = {row.module for row in catalog.STRATEGIES.values()}
    strategies |= {catalog.module_of(name, "deepspeed", pp, experts) for name in catalog.STRATEGIES
                   for pp in (1, 2) for experts in (0, 1)}
    return {"harness.strategies": strategies, "harness.run.job": set(catalog.LAUNCHERS.values())}


def floor_of(module: str) -> int:
    """The index of the module's floor (0 = ground); the longest matching name or prefix decides."""
    best, floor = -1, None
    for i, (_, names) in enumerate(FLOORS):
        for n in names:
            if (module == n or (n.endswith(".") and module.startswith(n))) and len(n) > best:
                best, floor = len(n), i
    if floor is None:
        raise KeyError(f"{module} is on no floor: add it to FLOORS in harness/tools/import_floors.py")
    return floor


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every arrow that runs back up a floor, documented or not."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if floor_of(d) > floor_of(m))


def drawing(graph: dict[str, set[str]]) -> str:
    lines = []
    for i in reversed(range(len(FLOORS))):
        name = FLOORS[i][0]
        mods = sorted(m for m in graph if floor_of(m) == i)
        down: dict[str, int] = {}
        for m in mods:
            for d in graph[m]:
                j = floor_of(d)
                if j < i:
                    down[FLOORS[j][0]] = down.get(FLOORS[j][0], 0) + 1
        lines.append(f"{i} {name} ({len(mods)} modules)")
        lines.append("    " + " ".join(mods))
        if down:
            lines.append("    v " + ", ".join(f"{n}: {c}" for n, c in sorted(down.items(), key=lambda kv: -kv[1])))
    up = upward(graph)
    lines.append(f"arrows back up a floor: {len(up)}")
    for m, d in up:
        why = EXCEPTIONS.get((m, d))
        lines.append(f"    ^ {m} ({FLOORS[floor_of(m)][0]}) -> {d} ({FLOORS[floor_of(d)][0]}): "
                     + (why or "NOT DOCUMENTED"))
    return "\n".join(lines)


def main() -> int:
    graph = import_graph()
    print(drawing(graph))
    return 1 if any(a not in EXCEPTIONS for a in upward(graph)) else 0


if __name__ == "__main__":
    sys.exit(main())
