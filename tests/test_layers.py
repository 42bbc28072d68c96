"""The package's shape: layers as folders, imports only downwards, no import cycle, small modules.

Every ``import`` of every module in ``distopt/`` is read from the source
(function-level and ``TYPE_CHECKING`` imports included) and resolved to the
module it names.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "distopt"

#: Layers from the top (the face) down; a module may import its own layer or any layer below it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("elastic", ("distopt.elastic",)),
    ("face", ("distopt", "distopt.opt", "distopt.singa", "distopt.collectives", "distopt.array_collectives",
              "distopt.async_collectives", "distopt.autograd", "distopt.grouped_collectives",
              "distopt.sparse_collectives", "distopt.compression", "distopt.accumulation")),
    ("torch", ("distopt.torch",)),
    ("step", ("distopt.step", "distopt.sharding")),
    ("strategies", ("distopt.strategies",)),
    ("compress", ("distopt.compress",)),
    ("launch", ("distopt.launch",)),
    ("services", ("distopt.data", "distopt.metrics", "distopt.checkpoint", "distopt.portable", "distopt.optim")),
    ("comm", ("distopt.comm",)),
    ("launch information", ("distopt.launch.info", "distopt.launch.ranks", "distopt.launch.devices",
                            "distopt.launch.nccl_id", "distopt.launch.logs")),
    ("core", ("distopt.core", "distopt.errors")),
)

MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best, rank = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            fits = module == prefix or (prefix != "distopt" and module.startswith(prefix + "."))
            if fits and len(prefix) > best:
                best, rank = len(prefix), i
    if rank < 0:
        raise AssertionError(f"module {module} belongs to no layer: add it to LAYERS in {__file__}")
    return rank


def _imports(module: str, path: Path) -> set[str]:
    """The distopt modules ``module`` imports (a name imported from a package that is a module counts
    as that module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "distopt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "distopt":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs or [target])
    found.discard(module)
    return {m for m in found if m in MODULES}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_only_run_down_the_layers():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m, targets in GRAPH.items() for t in sorted(targets) if _layer(t) < _layer(m)]
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


def test_import_graph_has_no_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_can_fail():
    """The resolver sees a relative import, and the layer rule orders face above comm."""
    assert "distopt.step.runner" in GRAPH["distopt.opt"]
    assert _layer("distopt.opt") < _layer("distopt.comm.base") < _layer("distopt.errors")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_is_at_most_400_lines(module: str):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES}): split it by responsibility"


README = PACKAGE.parent / "README.md"


def _readme_block(marker: str) -> list[str]:
    lines = README.read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->") + 2  # the marker, then the opening fence
    end = lines.index("```", start)
    return lines[start:end]


def test_readme_layout_names_every_folder_and_only_existing_paths():
    named = [line.split()[0] for line in _readme_block("layout")]
    missing = [p for p in named if not (PACKAGE.parent / p).exists()]
    assert not missing, f"README's layout names paths that do not exist: {missing}"
    folders = sorted(f"distopt/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    unlisted = [f for f in folders if f not in named]
    assert not unlisted, f"README's layout does not list {unlisted}"


def test_readme_strategy_table_lists_every_strategy():
    import inspect

    import distopt.strategies as strategies

    concrete = [c for c in vars(strategies).values()
                if inspect.isclass(c) and issubclass(c, strategies.Strategy) and getattr(c, "name", None)]
    assert len(concrete) >= 6
    text = README.read_text()
    missing = [c.__name__ for c in concrete if f"`{c.__name__}(" not in text]
    assert not missing, f"README's strategy table does not list {missing}"
