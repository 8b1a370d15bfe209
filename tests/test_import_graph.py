"""The library's modules import one another without a circle and only downwards: the import
graph of ``lib/crosskd`` (every ``import`` / ``from ... import`` of a ``crosskd`` module, at
module level or inside a function, read with ``ast``) is acyclic, and no module imports a module
of a higher layer of :data:`LAYERS`. A circle or an upward import hidden by a function-level
import still couples its modules both ways; this test finds it by name. Imports sit at the
module top: an import inside a function (outside the command line's ``crosskd/cli.py``) says why
on the line above (``# lazy: ...``)."""

from __future__ import annotations

import ast
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("crosskd", "crosskd.errors", "crosskd.ragged", "crosskd.transfer"),
    ("crosskd.config", "crosskd.ranges", "crosskd.artifacts"),
    ("crosskd.output_layer",),  # the head's input, which the loss and the scorer fuse with
    ("crosskd.zoo",),  # the zoo's tokenizers and files
    ("crosskd.tokenization",),
    ("crosskd.zoo.models",),  # the zoo's models, with their tokenizers
    ("crosskd.tables",),
    ("crosskd.projection",),  # X-Token's matrix, built from the tables
    ("crosskd.alignment",),
    ("crosskd.data",),
    ("crosskd.teacher.signal",),  # what a teacher gives the loss
    ("crosskd.serve.protocol",),  # the teacher server's wire format, which its client shares
    ("crosskd.loss",),
    ("crosskd.metrics",),  # the training metrics name the loss's terms
    ("crosskd.parallel",),  # the mesh carries the sharded loss's groups
    ("crosskd.teacher",),
    ("crosskd.serve",),  # the teacher server: config, batcher, HTTP
    ("crosskd.evaluate", "crosskd.generate", "crosskd.paired"),
    ("crosskd.transplant", "crosskd.shrink"),  # a student made from a pretrained model
    ("crosskd.train",),  # the trainer evaluates on held-out data
    ("crosskd.k8s",),
    ("crosskd.steps",),  # the training step renders and submits a job
    ("crosskd.distill", "crosskd.pipeline"),
    ("crosskd.cli",),
)
"""The library's layers, lowest first. A module belongs to the layer of the longest entry that is
its name or a package above it (``crosskd`` itself only to the first); it may import modules of
its own layer and of lower ones."""


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in (LIB / "crosskd").rglob("*.py"):
        name = ".".join(path.relative_to(LIB).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` refers to: itself, or the innermost module holding it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``crosskd`` modules it imports (an imported name that is a submodule
    counts as that submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                found = _resolve(target, modules) if target.startswith("crosskd") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (module docstring of :data:`LAYERS`)."""
    found, length = 0, 0
    for index, layer in enumerate(LAYERS):
        for entry in layer:
            placed = module == entry or (entry != "crosskd" and module.startswith(f"{entry}."))
            if placed and len(entry) > length:
                found, length = index, len(entry)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every ``(module, imported)`` where ``imported`` is of a higher layer, sorted."""
    return sorted(
        (module, other)
        for module, others in graph.items()
        for other in others
        if layer_of(other) > layer_of(module)
    )


def function_imports(source: str) -> list[tuple[int, bool]]:
    """Every import inside a function of ``source``: ``(line, reasoned)``, reasoned when the
    comment block right above it, or above the run of imports it ends, has a line starting
    with ``# lazy:``."""
    lines = source.splitlines()
    found = [
        node
        for function in ast.walk(ast.parse(source))
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    starts = {node.end_lineno: node.lineno for node in found}
    result = set()
    for node in found:
        above = node.lineno - 1
        while above in starts:
            above = starts[above] - 1
        comments = []
        while above >= 1 and lines[above - 1].strip().startswith("#"):
            comments.append(lines[above - 1].strip())
            above -= 1
        result.add((node.lineno, any(c.startswith("# lazy:") for c in comments)))
    return sorted(result)


def library_function_imports() -> dict[str, list[tuple[int, bool]]]:
    """:func:`function_imports` of every module but the command line's own
    (``crosskd/cli.py``: each command imports its own code when it runs), by path under
    ``lib/``."""
    return {
        str(path.relative_to(LIB)): function_imports(path.read_text())
        for path in sorted((LIB / "crosskd").rglob("*.py"))
        if path != LIB / "crosskd" / "cli.py"
    }


def test_circles_are_found():
    """The finder itself: a made-up graph with one circle of three and a separate edge."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_library_imports_without_circles():
    """Every module is read (a few known edges are there: a function-level import too), and
    there is no circle. (Before: five, one of seven modules closed by the training pod's entry
    point importing the trainer for an exception's exit code.)"""
    graph = import_graph()
    assert len(graph) > 100
    assert {"crosskd.errors", "crosskd.train.checkpoint"} <= graph["crosskd.train.launch"]
    assert "crosskd.train.trainer" not in graph["crosskd.train.launch"]
    assert "crosskd.teacher.sharded" in graph["crosskd.steps.score"]  # inside a function
    assert circles(graph) == []


def test_every_module_has_a_layer():
    """A new package or top-level module is placed in :data:`LAYERS` on purpose, not left to
    ``crosskd``'s layer; each entry names a module that exists."""
    modules = set(import_graph())
    assert sorted(m for m in modules if layer_of(m) == 0 and m not in LAYERS[0]) == []
    assert sorted(e for layer in LAYERS for e in layer if e not in modules) == []


def test_upward_imports_are_found():
    """The check itself: an import of a higher layer is reported, the same layer and lower
    ones are not."""
    graph = {
        "crosskd.loss.csd": {"crosskd.teacher.scoring", "crosskd.teacher.signal"},
        "crosskd.teacher.model": {"crosskd.zoo.models", "crosskd.teacher.signal"},
        "crosskd.train.trainer": {"crosskd.evaluate"},
        "crosskd.evaluate": {"crosskd.train.trainer"},
    }
    assert upward_imports(graph) == [
        ("crosskd.evaluate", "crosskd.train.trainer"),
        ("crosskd.loss.csd", "crosskd.teacher.scoring"),
    ]


def test_the_library_imports_only_downwards():
    """No module imports a module of a higher layer, at module level or inside a function.
    (Before: twelve, the sharded teacher and evaluate importing the trainer's parallelism and
    its rendezvous, and the loss importing the teacher signal through the ``crosskd.teacher``
    package.)"""
    graph = import_graph()
    assert "crosskd.parallel.parallelize" in graph["crosskd.teacher.sharded"]
    assert "crosskd.teacher.signal" in graph["crosskd.loss.csd"]
    assert upward_imports(graph) == []


def test_reasons_of_function_imports_are_found():
    """The check itself: a ``# lazy:`` comment block above an import, or above the run of
    imports it belongs to, is a reason; another comment or none is not."""
    source = (
        "def f():\n"
        "    # lazy: heavy\n"
        "    # and optional\n"
        "    import a\n"
        "    from b import (\n"
        "        c,\n"
        "    )\n"
        "    x = 1\n"
        "    # not a reason\n"
        "    import d\n"
        "    import e\n"
        "import g\n"
    )
    assert function_imports(source) == [(4, True), (5, True), (10, False), (11, False)]


def test_function_level_imports_say_why():
    """Every import inside a function outside ``crosskd/cli.py`` has its reason on the line
    above (heavy or optional dependencies its module's light callers must not pay for).
    (Before: 165, none with a reason; after hoisting the others: 45.)"""
    found = library_function_imports()
    counts = {path: len(imports) for path, imports in found.items() if imports}
    print(f"function-level imports outside crosskd/cli.py: {sum(counts.values())}", counts)
    unreasoned = [
        f"{path}:{line}" for path, imports in found.items() for line, why in imports if not why
    ]
    assert unreasoned == []


def drawn_layers(markdown: str) -> list[tuple[str, ...]]:
    """The layers of the drawing in ``docs/architecture.md`` (the code block whose header is
    ``layer  owns  may import``), highest first: the names in each row's first column (a row
    starts where that column is not blank; ``errors`` stands for ``crosskd.errors``)."""
    block = markdown.split("\nlayer ", 1)[1].split("```", 1)[0]
    rows = block.splitlines()[2:]
    return [tuple(name.strip() for name in row[:28].split(",")) for row in rows if row[:28].strip()]


def test_the_architecture_drawing_shows_these_layers():
    """``docs/architecture.md`` draws :data:`LAYERS` as they are, highest first."""
    text = (LIB.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    want = [
        tuple(name.removeprefix("crosskd.") for name in layer if name != "crosskd")
        for layer in reversed(LAYERS)
    ]
    assert drawn_layers(text) == want
