"""The package reads bottom-up: the import graph of ``hybridtrain/`` (every ``import``, also those inside
functions, read from the source with ``ast``) has no cycle, and the plan and config layers stay free of
DeepSpeed."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hybridtrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> hybridtrain modules it imports`` (``from pkg import name`` counts as ``pkg.name`` when
    that is a module, else ``pkg``). Importing ``a.b.c`` also runs the ``__init__`` of the packages
    ``a.b`` and ``a`` first, so those count too, except the importer's own packages (already running)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
            if is_pkg:
                own.add(name)
            for t in targets:
                while t and t not in modules:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                while t and t.startswith("hybridtrain"):  # the module, then the packages it runs first
                    if t != name and t not in own:
                        graph[name].add(t)
                    t = t.rpartition(".")[0]
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "hybridtrain.plan" in graph["hybridtrain.__main__"]
    assert "hybridtrain.config.schema" in graph["hybridtrain.config"]


def test_a_package_init_counts_for_its_submodules():
    graph = import_graph()
    # rundir imports hybridtrain.plan.types, which runs hybridtrain/plan/__init__.py first
    assert "hybridtrain.plan" in graph["hybridtrain.rundir"]
    assert "hybridtrain.plan" not in graph["hybridtrain.plan.validate"]  # its own package is already running


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative ``tests/`` is no package): two
    ``test_x.py`` in different tiers stop the whole collection ("import file mismatch")."""
    from collections import Counter
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
