"""The layering, kept by a test: imports only point down, and no module imports itself back.

api (create/load, CLI, build, tune) → rpc → runtime → relay_passes → base (graph, devices,
lifetimes, errors, artifacts). The scan reads every import statement, lazy ones inside
functions included, and maps folders onto modules as pyproject.toml's package-dir does.
"""

from __future__ import annotations

import ast
import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"hgrt.graph", "hgrt.devices", "hgrt.lifetimes", "hgrt.errors", "hgrt.artifacts"}
LAYERS = ("api", "rpc", "runtime", "relay_passes", "base")  # top to bottom


def layer_of(module: str) -> str:
    if module in BASE:
        return "base"
    for name in ("rpc", "runtime", "relay_passes"):
        if module == f"hgrt.{name}" or module.startswith(f"hgrt.{name}."):
            return name
    return "api"


def product_modules() -> dict[str, str]:
    """module name -> file, through the package-dir mapping."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in mapping.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                stem = name[:-3]
                module = package if stem == "__init__" else f"{package}.{stem}"
                modules[module] = os.path.join(ROOT, folder, name)
    return modules


def imports(path: str, modules: dict[str, str]) -> set[str]:
    """The product modules ``path`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in modules]
            names += [node.module] if len(names) < len(subs) else []
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {m: imports(path, modules) - {m} for m, path in modules.items()}


def test_the_scan_sees_every_layer():
    graph = import_graph()
    assert {layer_of(m) for m in graph} == set(LAYERS)
    assert "hgrt.relay_passes.lower" in graph and "hgrt.rpc.client" in graph
    assert "hgrt.runtime.executor" in graph["hgrt.rpc.server"]  # edges across folders are seen


def test_imports_only_point_down():
    up = [f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
          for src, dsts in import_graph().items() for dst in sorted(dsts)
          if LAYERS.index(layer_of(dst)) < LAYERS.index(layer_of(src))]
    assert up == []


def test_no_import_circles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # a package's __init__ re-exporting its own modules is not a circle of ideas
    circles = [c for c in circles
               if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert circles == []
