"""The package's layout: no import circle, one registry loaded once."""

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memcalc"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """memcalc modules ``path`` imports, at any depth of the file (``from pkg import sub``
    counts as ``pkg.sub`` when ``sub`` is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memcalc"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if importlib.util.find_spec(node.module) and _is_module(sub) else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("memcalc"))
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or (PACKAGE.parent / rel).is_dir()


def graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``g`` (a module reaching itself), or None."""
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]):
        state[node] = 1
        for dep in sorted(g.get(node, ())):
            if dep == node:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep in g and dep not in state:
                found = visit(dep, stack + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(g):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_checker_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    assert cycle(graph()) is None


def test_a_name_registered_twice_is_refused():
    from memcalc.impls.registry import register

    with pytest.raises(ValueError, match="already registered"):
        register("naive", "a second naive")(lambda d: None)


# The layers of the flow, lowest first: config -> program -> replay -> result -> render.
# A module may import modules of its own layer and of the layers below, never above.
LAYERS = (
    ("memcalc.errors",),
    ("memcalc.engine",),  # sizes, allocator, program, replay, recorder, deadline
    ("memcalc.impls",),  # the registry and one module per implementation
    ("memcalc.config", "memcalc.gpus", "memcalc.names"),  # what a user asks for
    ("memcalc.output",),  # how a result shows itself
    ("memcalc.analysis",),  # the questions: breakdown, budget, solver, sweep, compare
    ("memcalc.tracing",),  # a user's code, traced into a program
    ("memcalc.compiling",),  # torch.compile in that code, as inductor compiles it
    ("memcalc.validation",),  # the model against a trace or a GPU
    ("memcalc.plots",),
    ("memcalc.options",),  # the commands' shared options, read into the library's models
    ("memcalc.commands",),
    ("memcalc.cli",),  # the parser over the commands, and main
    ("memcalc",),  # the public face
)
TOP_LEVEL_MODULES = 9


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix of ``module``."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (i, name)
    assert best is not None, f"{module} is in no layer of tests/test_structure.py"
    return best[0]


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of ``g`` that runs from a layer to a higher one."""
    return sorted(f"{m} -> {d}" for m, deps in g.items() for d in deps
                  if d in g and layer(d) > layer(m))


def test_the_checker_finds_an_upward_import():
    assert upward({"memcalc.engine.replay": {"memcalc.analysis.predict"},
                   "memcalc.analysis.predict": {"memcalc.engine.replay"}}) == [
        "memcalc.engine.replay -> memcalc.analysis.predict"]


def test_imports_run_down_the_layers():
    """Lazy imports inside functions count too: a dependency is one wherever it is written."""
    assert upward(graph()) == []


def test_the_top_level_keeps_the_public_face():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, modules


def test_each_package_says_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, init
