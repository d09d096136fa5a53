"""The package's layers point one way: no module imports a layer above its own.

Read from the source (every `import`, at module level or inside a function),
so a lazy import cannot hide a wrong dependency. Packages in the same layer
are siblings and may not import each other either: data/ knows nothing of
distributed/, and neither knows models or observe. Within a layer group,
modules may import each other, but no import forms a circle; and no module
is over MAX_LINES lines.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_cli"

# bottom to top; each entry is one layer of sibling groups (a module belongs to its longest prefix)
LAYERS: list[tuple[str, ...]] = [
    # the foundations, at the package's top
    ("ddp_cli", "ddp_cli.errors", "ddp_cli.fastexit"),
    ("ddp_cli.io", "ddp_cli.userfiles", "ddp_cli.flops"),
    # the run config: its sections, the syntax of a model's name, loading, and the one resolve pass (from
    # facts handed in: it imports nothing of the layers above)
    ("ddp_cli.config",),
    # data/'s rooms: bytes from storage, the listing of a data set, the input pipeline, writing shards
    ("ddp_cli.data", "ddp_cli.data.fetch"),
    ("ddp_cli.data.sources",),
    ("ddp_cli.data.pipeline",),
    # models: zoo (builders), tweaks, weights, finetune and check, importing each other (no circle)
    ("ddp_cli.data.pack", "ddp_cli.distributed", "ddp_cli.models", "ddp_cli.observe"),
    # data/'s top: the registry (data.toml) and the run's index build, above the rooms that never read it
    ("ddp_cli.data.registry",),
    ("ddp_cli.data.index_build", "ddp_cli.data.thumbnails"),
    # a sweep's space (read against the run config) and its study's storage
    ("ddp_cli.sweep.space", "ddp_cli.sweep.storage"),
    ("ddp_cli.train",),
    ("ddp_cli.sweep.pruning",),  # the trial's side of a sweep: the run's epoch ends reported to the study
    ("ddp_cli.run",),
    # the sweep's loop (trials as `ddp train` processes) and its report
    ("ddp_cli.sweep.trials",),
    ("ddp_cli.sweep.report",),
    ("ddp_cli.sweep",),
    # every rule a run must pass, the facts gathered and the config resolved once: below the command line,
    # so train, dry runs and the torchrun path reach the same one
    ("ddp_cli.preflight",),
    # cli/, the front door: the kit (drawing results, exit codes, declaring commands to Typer) beside
    # the helpers of single commands (init, config, env)
    ("ddp_cli.cli.render", "ddp_cli.cli.starter", "ddp_cli.cli.config_view", "ddp_cli.cli.envinfo"),
    ("ddp_cli.cli.exits",),
    ("ddp_cli.cli.clikit",),
    # the product's commands (cli/commands/: a module per job), and beside them (neither imports the
    # other) the benchmarks: a tool
    ("ddp_cli.cli.plan", "ddp_cli.cli.commands", "ddp_cli.bench"),
    # the Typer apps: `ddp` (cli/ddp.py), the sub-apps it mounts (cli/datasets.py, cli/config.py,
    # cli/sweep.py) and `ddp bench`'s door (cli/bench.py)
    ("ddp_cli.cli",),
    ("ddp_cli.__main__",),
]
# one layer, one job: commands
SHARED_GROUP = {"ddp_cli.cli.plan", "ddp_cli.cli.commands"}


def group_of(module: str) -> str:
    """The layer group `module` belongs to; a module no group names has no layer (an error)."""
    groups = [g for layer in LAYERS for g in layer]
    owners = [g for g in groups if module == g or (g != "ddp_cli" and module.startswith(g + "."))]
    if not owners:
        raise AssertionError(f"{module} belongs to no layer; add it to LAYERS")
    return max(owners, key=len)


def layer_of(group: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if group in layer)


@functools.cache
def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def imports(path: Path, module: str = "") -> set[str]:
    """Every ddp_cli module `path` imports, in any form: `import ddp_cli.x`, `from ddp_cli.x import y`,
    `from ddp_cli import x` (x may be a module: then x is what is imported, the package only as its parent,
    which any import of a submodule initialises first) and relative imports (`from .x import y`,
    resolved against `module`, the importing module's name)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            submodules = {name for alias in node.names if (name := f"{base}.{alias.name}") in modules()}
            names.update(submodules)
            if len(submodules) < len(node.names):  # a name of the package itself (its __init__)
                names.add(base)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "ddp_cli" or n.startswith("ddp_cli.")} - {module}


def violations(module: str, targets: set[str]) -> list[str]:
    mine, found = group_of(module), []
    for target in sorted(targets):
        theirs = group_of(target)
        if theirs == mine or (mine in SHARED_GROUP and theirs in SHARED_GROUP):
            continue
        if layer_of(theirs) >= layer_of(mine):
            found.append(f"{module} imports {target}: layer {layer_of(theirs)} ({theirs}) is not "
                         f"below layer {layer_of(mine)} ({mine})")
    return found


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_imports_a_layer_above_or_a_sibling(module):
    assert violations(module, imports(modules()[module], module)) == []


def test_the_rule_refuses_upward_and_sibling_imports():
    assert violations("ddp_cli.data.pipeline.check", {"ddp_cli.data.registry"})  # data/ reading the registry
    assert violations("ddp_cli.data.fetch.storage", {"ddp_cli.data.sources.table"})  # a room above
    assert violations("ddp_cli.data.pipeline.loaders", {"ddp_cli.distributed.setup"})  # siblings
    assert violations("ddp_cli.train.trainer", {"ddp_cli.run.worker"})
    assert not violations("ddp_cli.run.worker", {"ddp_cli.train.trainer", "ddp_cli.run.jobs"})
    assert violations("ddp_cli.cli.commands.training", {"ddp_cli.bench.step"})  # the product using the bench
    assert violations("ddp_cli.preflight", {"ddp_cli.bench.faultproxy"})
    assert violations("ddp_cli.bench.e2e", {"ddp_cli.cli.commands.training"})  # nor the tool the door
    assert violations("ddp_cli.cli.commands.datasets", {"ddp_cli.cli.datasets"})  # nor the door its Typer app
    assert not violations("ddp_cli.cli.ddp", {"ddp_cli.cli.bench", "ddp_cli.cli.datasets",
                                              "ddp_cli.cli.commands.training"})
    assert not violations("ddp_cli.cli.commands.training", {"ddp_cli.cli.commands.run_dirs"})
    assert not violations("ddp_cli.cli.bench", {"ddp_cli.bench.step", "ddp_cli.cli.clikit"})  # the door
    assert violations("ddp_cli.config", {"ddp_cli.models.zoo"})  # config reads model names, builds none
    assert violations("ddp_cli.models.zoo", {"ddp_cli.train.export"})  # models know no checkpoint
    assert violations("ddp_cli.models.weights", {"ddp_cli.train.checkpoint"})
    assert violations("ddp_cli.config.resolve", {"ddp_cli.models.families"})  # facts are handed in
    assert not violations("ddp_cli.models.check", {"ddp_cli.models.zoo", "ddp_cli.models.weights"})
    with pytest.raises(AssertionError, match="no layer"):
        group_of("ddp_cli.newthing")


def test_every_import_form_is_read(tmp_path):
    """`from ddp_cli import x` and relative imports are imports too (once a blind spot)."""
    source = tmp_path / "m.py"
    source.write_text("from ddp_cli.data import registry\nfrom ..sources import table\nfrom . import retry\n"
                      "def f():\n    from ...run.worker import run_job\n")
    found = imports(source, "ddp_cli.data.fetch.storage")
    assert {"ddp_cli.data.registry", "ddp_cli.data.sources.table", "ddp_cli.data.fetch.retry",
            "ddp_cli.run.worker"} <= found
    assert violations("ddp_cli.data.fetch.storage", found)
    # a package's own names are its __init__'s: an import of it; its submodules alone are not
    source.write_text("from ddp_cli.cli import render\nfrom ddp_cli.models import TinyResNet\n")
    found = imports(source, "ddp_cli.cli.ddp")
    assert "ddp_cli.cli.render" in found and "ddp_cli.cli" not in found and "ddp_cli.models" in found


@pytest.mark.parametrize("package", sorted(m for m, path in modules().items() if path.name == "__init__.py"))
def test_every_package_says_what_it_holds_and_what_it_may_import(package):
    """A room's door says what is inside and whom it may call on, so the house reads at a glance."""
    doc = ast.get_docstring(ast.parse(modules()[package].read_text()), clean=False) or ""
    lines = doc.splitlines()
    assert len(lines) >= 2 and lines[0].strip() and "import" in lines[1], (
        f"{package}'s docstring: line 1 what it holds, line 2 what it may import")


def test_the_top_folder_holds_only_foundations():
    """At most ten modules beside the packages (__init__ and __main__ count): the rest lives in a room."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports."""
    return {module: imports(path, module) & modules().keys() for module, path in modules().items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative):
    each a set of modules that import each other, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return found


def test_no_import_forms_a_circle():
    """Layers allow imports within a group (cli/commands/, models/, the SHARED_GROUP); none may close a
    circle, lazy imports included, so each module can be read, tested and moved after what it uses."""
    assert circles(import_graph()) == []


def test_the_circle_check_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 500
MAX_CONFIG_LINES = 400  # the config package: the file every change of a default touches, kept small


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_is_over_max_lines(module):
    """A module holds one job; past MAX_LINES it holds several: split it by job, into modules named for
    what they hold."""
    path = modules()[module]
    name = path.relative_to(PACKAGE.parent).as_posix()
    lines = len(path.read_text().splitlines())
    limit = MAX_CONFIG_LINES if module.startswith("ddp_cli.config") else MAX_LINES
    assert lines <= limit, f"{name} is {lines} lines, over {limit}: split it by job"
