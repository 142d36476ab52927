"""The import graph points one way (docs/design.md "Layers"): every import inside piecewise, at
module level or inside a function, goes to a module of the same or a lower layer, and no set of
modules imports each other in a cycle. Read with `ast`, so lazy imports count too."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "piecewise"

#: lowest first; a module may import from its own layer and those before it. A package name
#: stands for all its modules. Kept in the same order as docs/design.md.
LAYERS: list[tuple[str, ...]] = [
    ("_torch",),  # torch internals (private names, patches), one module per torch subsystem
    ("_version", "errors", "targets", "registry", "tags", "fingerprint", "counters", "forward_context", "threads"),
    ("ops", "state", "inputs"),
    ("passes",),
    ("config",),
    ("split",),
    ("cache",),
    ("compilers",),
    ("piece",),
    ("graphs",),
    ("compiled",),
    ("backend",),
    ("trace",),
    ("warmstart",),
    ("api",),
    ("serving",),  # the serving engine: reference decoder, batching loop, Triton attention, tensor parallelism
    ("hf",),  # the transformers integration (its chat turn drives the serving engine's decoder too)
    ("testing",),  # fixtures for tests and benchmarks (toy models, fake graph platform, Redis server)
    ("models", "bench", "demo", "cli", "__main__", ""),  # "" is the package root (lazy re-exports)
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["piecewise", *parts])] = p
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py; add it to LAYERS and docs/design.md")


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The piecewise modules `node` imports (a name imported from a package that is a submodule
    counts as that submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == "piecewise"]
    else:
        if node.level:
            base = module.split(".")
            if MODULES[module].name != "__init__.py":
                base = base[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        if mod.split(".")[0] != "piecewise":
            return []
        names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    out = []
    for n in names:
        while n not in MODULES:
            n = n.rsplit(".", 1)[0]
        out.append(n)
    return out


def _edges() -> list[tuple[str, str, int]]:
    edges = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.extend((module, t, node.lineno) for t in _targets(module, node) if t != module)
    return edges


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_goes_up_a_layer():
    up = [f"{m}:{line} imports {t} (layer {_layer(t)} > {_layer(m)})" for m, t, line in _edges() if _layer(t) > _layer(m)]
    assert not up, "imports that go up a layer:\n" + "\n".join(up)


def _cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # A package's __init__ re-exporting its submodules is not a cycle when the submodules never
    # import the package itself; every other mutual import is.
    cycles = _cycles(_edges())
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("bad", ["up", "cycle"])
def test_the_checks_catch_what_they_are_for(bad):
    """The two checks fail on a made-up violation (a check that cannot fail is no check)."""
    if bad == "up":
        edges = [("piecewise.errors", "piecewise.api", 1)]
        assert [e for e in edges if _layer(e[1]) > _layer(e[0])]
    else:
        edges = [("piecewise.split", "piecewise.ops", 1), ("piecewise.ops", "piecewise.split", 2)]
        assert _cycles(edges) == [["piecewise.ops", "piecewise.split"]]


def _swallows_silently(handler: ast.ExceptHandler) -> bool:
    """An ``except Exception`` (or ``BaseException``, or bare) block that neither raises, nor logs
    or warns, nor keeps the exception (its name used in the block, e.g. in a recorded reason)."""
    names = {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)} if handler.type is not None else {"bare"}
    if not names & {"Exception", "BaseException", "bare"}:
        return False
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in ("log", "logging", "warnings"):
                return False
        if handler.name and isinstance(node, ast.Name) and node.id == handler.name:
            return False
    return True


def test_every_broad_except_logs_or_keeps_what_it_caught():
    silent = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ExceptHandler) and _swallows_silently(node):
                silent.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not silent, "broad except blocks that drop the exception without a word: " + ", ".join(silent)


def test_the_except_check_catches_a_silent_block():
    tree = ast.parse("try:\n    f()\nexcept Exception:\n    pass\n")
    handler = tree.body[0].handlers[0]
    assert _swallows_silently(handler)
    tree = ast.parse("try:\n    f()\nexcept Exception as e:\n    log.debug('%s', e)\n")
    assert not _swallows_silently(tree.body[0].handlers[0])
