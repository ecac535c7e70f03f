"""Layers that point one way: every ``speculant`` module's imports of other ``speculant`` modules (at
module level and inside functions alike) go to its own layer or one below, and the import graph has
no cycle. A tool that drives the whole stack (a Generator, the engine) lives above what it drives,
never beside the core it uses."""
import ast
import importlib
import pkgutil
from pathlib import Path

import speculant

ROOT = Path(speculant.__file__).parent

# lowest first; a module belongs to the longest prefix that names it (``speculant`` alone: the package)
LAYERS = [
    ("base", ["speculant.errors", "speculant.files", "speculant.limits", "speculant.rows", "speculant.version",
              "speculant.schema_keywords"]),
    ("kernels", ["speculant.sampling", "speculant.verify", "speculant.tree", "speculant.schema_worker",
                 "speculant.constrain"]),
    ("models", ["speculant.models"]),
    ("trained networks", ["speculant.trained"]),
    ("drafters", ["speculant.drafters"]),
    ("controller", ["speculant.controller"]),
    ("engine", ["speculant.engine"]),
    ("api", ["speculant.api"]),
    ("tools", ["speculant.tools", "speculant.check", "speculant.export", "speculant.bench"]),
    ("server", ["speculant.server"]),
    ("entry points", ["speculant", "speculant.cli", "speculant.__main__", "speculant.bench.serve_load",
                      "speculant.bench.hostile_load"]),
]
# optional extras: a module that needs one that is not installed is left out of the import check
EXTRAS = {"fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "lmformatenforcer", "openai",
          "scipy", "arctic_inference", "matplotlib", "rich", "tqdm"}
RUNS_ON_IMPORT = {"speculant.__main__"}  # `python -m speculant`: runs the CLI when imported


def layer_of(module: str, layers=LAYERS) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            hit = module == p or (p != "speculant" and module.startswith(p + "."))
            if hit and len(p) > best:
                best, found = len(p), i
    if found is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return found


def modules(root: Path = ROOT, package: str = "speculant") -> dict[str, Path]:
    """Every module of the package: dotted name -> its file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def imports(name: str, source: str, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported speculant module, line, inside a function) for each import in ``source`` of module
    ``name``; ``from X import y`` names X.y where that is a module."""
    package = name if name in PACKAGES else name.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub if sub in known else target, child.lineno, in_function))
            visit(child, inner)

    visit(ast.parse(source), False)
    return [(m, line, f) for m, line, f in dict.fromkeys(found) if m == "speculant" or m.startswith("speculant.")]


def upward_imports(sources: dict[str, str], layers=LAYERS) -> list[str]:
    """Every import of a module in a higher layer, as 'importer (layer) line N -> imported (layer)'."""
    known = set(sources)
    bad = []
    for name, source in sources.items():
        mine = layer_of(name, layers)
        for target, line, in_function in imports(name, source, known):
            theirs = layer_of(target, layers)
            if theirs > mine:
                where = "in a function" if in_function else "at module level"
                bad.append(f"{name} ({layers[mine][0]}) line {line}, {where} -> {target} ({layers[theirs][0]})")
    return bad


def cycles(sources: dict[str, str]) -> list[list[str]]:
    """Import cycles among the modules (strongly connected components of more than one module)."""
    known = set(sources)
    graph = {name: {t for t, _, _ in imports(name, src, known) if t in known and t != name}
             for name, src in sources.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


SOURCES = {name: path.read_text() for name, path in modules().items()}
PACKAGES = {name for name, path in modules().items() if path.name == "__init__.py"}


def test_every_module_is_in_a_layer():
    for name in SOURCES:
        layer_of(name)


def test_imports_point_down_the_layers():
    bad = upward_imports(SOURCES)
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_the_import_graph_has_no_cycle():
    assert cycles(SOURCES) == []


def test_an_upward_import_is_reported():
    """The checker itself: a drafter importing the API (at module level, or inside a function),
    and a cycle between two modules, are caught."""
    sources = dict(SOURCES)
    sources["speculant.drafters.ngram"] += "\nfrom ..api import Generator\n"
    sources["speculant.models.kv"] += "\ndef later():\n    from ..tools import loader\n    return loader\n"
    bad = upward_imports(sources)
    assert any(b.startswith("speculant.drafters.ngram (drafters)") and b.endswith("speculant.api (api)") for b in bad)
    assert any(b.startswith("speculant.models.kv (models)") and "in a function" in b
               and b.endswith("speculant.tools.loader (tools)") for b in bad)
    assert len(bad) == 2, bad
    sources["speculant.trained.losses"] = SOURCES["speculant.trained.losses"] + "\nfrom .eagle import EagleNet\n"
    assert ["speculant.trained.eagle", "speculant.trained.losses"] in cycles(sources)


def test_relative_imports_resolve_to_modules():
    known = set(SOURCES)
    found = imports("speculant.drafters.eagle", "from ..trained import eagle as t\nfrom .base import Drafter\n"
                    "from . import spec\nimport speculant.api\n", known)
    assert [m for m, _, _ in found] == ["speculant.trained.eagle", "speculant.drafters.base",
                                         "speculant.drafters.spec", "speculant.api"]
    assert [m for m, _, _ in imports("speculant.drafters", "from .registry import KINDS\n", known)] == [
        "speculant.drafters.registry"]


def _missing_extra(e: ImportError) -> bool:
    return (e.name or "").split(".")[0] in EXTRAS


def test_every_module_imports_in_layer_order():
    names = [m.name for m in pkgutil.walk_packages(speculant.__path__, "speculant.")] + ["speculant"]
    assert set(names) == set(SOURCES)
    for name in sorted(names, key=lambda n: (layer_of(n), n)):
        if name in RUNS_ON_IMPORT:
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:  # a module of an optional extra that is not installed here
            if not _missing_extra(e):
                raise
