"""The layering, kept by a test: imports only point down, and no module imports itself back.

api (create/load, CLI, build, tune) → rpc → providers → runtime → relay_passes → base (graph,
devices, lifetimes, errors, artifacts, the spin settings, and the kernel providers' registry and
declarations).
The scan reads every import statement, lazy ones inside functions included, and maps folders
(and their sub-packages) onto modules as pyproject.toml's package-dir does.

Also kept here: the shape of the folder of passes (each pass of ``hgrt.compiler.PASSES`` in a
file of its own, named after it, in ``relay_passes/`` or, after ``graph_codegen``,
``relay_passes/graph/``; nothing else there; ``inner/`` and ``util/`` below the passes) and the
size of the product's files (600 lines at most) and functions (80 lines at most), and the
kernel providers' homes: a provider's modules live in ``providers/<name>/``, reach no other
provider, are reached by nothing but the registry, and no module outside names oneDNN in code.
"""

from __future__ import annotations

import ast
import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = {"hgrt.graph", "hgrt.graph_checks", "hgrt.graph_format", "hgrt.devices", "hgrt.lifetimes",
        "hgrt.errors", "hgrt.artifacts", "hgrt.spin"}
PROVIDERS = "hgrt.providers"  # the registry (base), one package per provider
LAYERS = ("api", "rpc", "providers", "runtime", "relay_passes", "base")  # top to bottom
PRODUCT = ("hgrt", "relay_passes", "runtime", "rpc", "providers")  # the product's folders
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
PASSES_PACKAGE = "hgrt.relay_passes"
GRAPH_PASSES_PACKAGE = "hgrt.relay_passes.graph"  # the passes after graph_codegen


def provider_of(module: str) -> str | None:
    """The provider whose folder holds ``module`` (``hgrt.providers.onednn.kernels`` ->
    ``onednn``), or None."""
    rest = module[len(PROVIDERS) + 1:].split(".") if module.startswith(PROVIDERS + ".") else []
    return rest[0] if rest and rest[0] != "registry" else None


def is_declaration(module: str) -> bool:
    """The registry and each provider's declaration (its folder's ``__init__``): base layer,
    what graph validation reads."""
    return module in (PROVIDERS, f"{PROVIDERS}.registry") or (
        provider_of(module) is not None and module.count(".") == 2)


def layer_of(module: str) -> str:
    if any(module == b or module.startswith(b + ".") for b in BASE) or is_declaration(module):
        return "base"
    if module.startswith(PROVIDERS + "."):
        return "providers"
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
        top = os.path.join(ROOT, folder)
        for here, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs
                             if os.path.exists(os.path.join(here, d, "__init__.py")))
            rel = os.path.relpath(here, top)
            pkg = package if rel == "." else ".".join([package, *rel.split(os.sep)])
            for name in sorted(files):
                if name.endswith(".py"):
                    stem = name[:-3]
                    module = pkg if stem == "__init__" else f"{pkg}.{stem}"
                    modules[module] = os.path.join(here, name)
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
    assert "hgrt.relay_passes.legalize_and_fuse" in graph and "hgrt.rpc.client" in graph
    assert "hgrt.runtime.executor" in graph["hgrt.rpc.server"]  # edges across folders are seen
    assert "hgrt.relay_passes.util.context" in graph  # and modules of sub-packages
    assert layer_of("hgrt.importer.rules") == "api" and "hgrt.importer.rules" in graph  # import


def test_pyproject_installs_every_package():
    """``packages`` is a list in pyproject.toml: a sub-package missing from it would be left out
    of a wheel (an editable install would not show it), and package-dir maps each one so that
    tools reading package-dir alone see its modules."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    packages = {m for m, path in product_modules().items() if path.endswith("__init__.py")}
    assert packages == set(setuptools["packages"]) == set(setuptools["package-dir"])


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


# ---- the folder of passes ----------------------------------------------------------------------

def kind_of_pass_module(module: str) -> str:
    """What a module of hgrt.relay_passes is: "pass" (relay_passes/*.py), "graph pass"
    (relay_passes/graph/), "inner" (relay_passes/inner/), "util" (relay_passes/util/)."""
    rest = module[len(PASSES_PACKAGE) + 1:].split(".")
    if len(rest) == 1:
        return "pass"
    return {"graph": "graph pass"}.get(rest[0], rest[0])


def pass_file_problems(passes: list[tuple[str, str]], files: list[str]) -> list[str]:
    """What breaks the rule "each pipeline pass in a file of its own, named after it": ``passes``
    as (name, module of its function) in pipeline order, ``files`` the modules of
    relay_passes' pass folders (``relay_passes/*.py`` and ``relay_passes/graph/*.py``, without
    their ``__init__``)."""
    names = [n for n, _ in passes]
    codegen = names.index("graph_codegen") if "graph_codegen" in names else len(names)
    problems = []
    homes = set()
    for i, (name, module) in enumerate(passes):
        if provider_of(module) is not None:  # a provider's pass: in its folder, named after it
            home = f"{PROVIDERS}.{provider_of(module)}.{name}"
            if module != home:
                problems.append(f"pass {name!r} is defined in {module}, not in {home}")
            continue
        folder = GRAPH_PASSES_PACKAGE if i > codegen else PASSES_PACKAGE
        want = f"{folder}.{name}"
        homes.add(want)
        if module != want:
            problems.append(f"pass {name!r} is defined in {module}, not in {want}")
    problems += [f"{m} is in a folder of pipeline passes but holds none of PASSES (move it to "
                 f"inner/ or util/)" for m in sorted(set(files) - homes)]
    return problems


def pass_folder_modules() -> list[str]:
    """The modules of relay_passes/*.py and relay_passes/graph/*.py (packages left out)."""
    return sorted(m for m, path in product_modules().items()
                  if m.rpartition(".")[0] in (PASSES_PACKAGE, GRAPH_PASSES_PACKAGE)
                  and not path.endswith("__init__.py"))


def test_each_pipeline_pass_lives_in_a_file_of_its_own():
    from hgrt.compiler import PASSES

    passes = [(name, fn.__module__) for name, fn in PASSES]
    assert pass_file_problems(passes, pass_folder_modules()) == []


def test_the_pass_file_rule_can_fail():
    good = [("a", "hgrt.relay_passes.a"), ("graph_codegen", "hgrt.relay_passes.graph_codegen"),
            ("plan", "hgrt.relay_passes.graph.plan")]
    files = [m for _, m in good]
    assert pass_file_problems(good, files) == []
    two_in_one = [("a", "hgrt.relay_passes.a"), ("b", "hgrt.relay_passes.a")]
    assert pass_file_problems(two_in_one, ["hgrt.relay_passes.a"]) == [
        "pass 'b' is defined in hgrt.relay_passes.a, not in hgrt.relay_passes.b"]
    graph_pass_on_top = [("graph_codegen", "hgrt.relay_passes.graph_codegen"),
                         ("plan", "hgrt.relay_passes.plan")]
    assert pass_file_problems(graph_pass_on_top, [])[0].startswith(
        "pass 'plan' is defined in hgrt.relay_passes.plan, not in hgrt.relay_passes.graph.plan")
    assert pass_file_problems(good, [*files, "hgrt.relay_passes.helper"]) == [
        "hgrt.relay_passes.helper is in a folder of pipeline passes but holds none of PASSES "
        "(move it to inner/ or util/)"]


def test_inner_passes_and_helpers_import_no_pass():
    """util/ imports only util/; inner/ imports inner/ and util/: the arrows of relay_passes
    point from the pipeline passes down to the passes they call and the helpers."""
    allowed = {"util": {"util"}, "inner": {"inner", "util"}}
    up = [f"{src} ({kind_of_pass_module(src)}) imports {dst} ({kind_of_pass_module(dst)})"
          for src, dsts in import_graph().items() if src.startswith(PASSES_PACKAGE + ".")
          for dst in sorted(dsts) if dst.startswith(PASSES_PACKAGE + ".")
          and kind_of_pass_module(src) in allowed
          and kind_of_pass_module(dst) not in allowed[kind_of_pass_module(src)]]
    assert up == []


# ---- sizes -------------------------------------------------------------------------------------

def oversized_in_source(source: str, path: str = "<source>") -> list[str]:
    """``path`` when ``source`` has more than MAX_FILE_LINES lines, and each function of it
    (methods and nested functions too) longer than MAX_FUNCTION_LINES, from its ``def`` line to
    its last."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_FILE_LINES:
        found.append(f"{path}: {lines} lines (at most {MAX_FILE_LINES}: split it by idea)")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno}: {node.name}() has {length} lines (at most "
                             f"{MAX_FUNCTION_LINES})")
    return found


def oversized(root: str = ROOT) -> list[str]:
    """Every product file, and every function of one, over its size."""
    found = []
    for folder in PRODUCT:
        for here, dirs, files in os.walk(os.path.join(root, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(here, name)
                    with open(path) as f:
                        found += oversized_in_source(f.read(), os.path.relpath(path, root))
    return found


def test_no_product_file_or_function_is_too_long():
    assert oversized() == []


def test_the_size_scan_names_the_offenders():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def long():\n{body}\n"  # the def line + 80: one too many
    assert oversized_in_source(long_function, "m.py") == [
        f"m.py:1: long() has {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    method = "class A:\n" + "\n".join("    " + line for line in long_function.splitlines())
    assert "m.py:2: long()" in oversized_in_source(method, "m.py")[0]
    assert oversized_in_source(f"def fine():\n{body[:-len(body.splitlines()[-1]) - 1]}\n") == []
    long_file = "\n".join(f"x{i} = {i}" for i in range(MAX_FILE_LINES + 1))
    assert oversized_in_source(long_file, "big.py") == [
        f"big.py: {MAX_FILE_LINES + 1} lines (at most {MAX_FILE_LINES}: split it by idea)"]
    assert oversized_in_source(long_file.rsplit("\n", 1)[0], "big.py") == []


# ---- kernel providers --------------------------------------------------------------------------

# Outside its folder, a provider is named in code by nothing but these modules, each for a reason
# that a registry cannot carry (at most 3):
PROVIDER_WORD_EXCEPTIONS = {
    "hgrt.providers": "the registry's one line per built-in provider imports its declaration",
}
PROVIDER_WORDS = {"onednn": ("onednn", "dnnl")}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (a module's, class's or function's)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.add(id(body[0].value))
    return found


def provider_mentions(source: str, words: tuple[str, ...]) -> list[str]:
    """Where ``source``'s code (docstrings and comments aside) names one of ``words``: a string
    constant (f-string parts included) or an imported module, as ``line: text``."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        texts = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            texts = [node.value]
        elif isinstance(node, ast.Import):
            texts = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            texts = [node.module or ""] + [a.name for a in node.names]
        for text in texts:
            if any(w in text.lower() for w in words):
                found.append(f"{node.lineno}: {text[:60]!r}")
    return found


def test_no_module_outside_a_provider_names_it_in_code():
    modules = product_modules()
    found = []
    for name, words in PROVIDER_WORDS.items():
        for module, path in sorted(modules.items()):
            if provider_of(module) == name or module in PROVIDER_WORD_EXCEPTIONS:
                continue
            with open(path) as f:
                found += [f"{module}:{hit}" for hit in provider_mentions(f.read(), words)]
    assert found == []
    assert len(PROVIDER_WORD_EXCEPTIONS) <= 3


def test_the_provider_word_scan_can_fail():
    words = PROVIDER_WORDS["onednn"]
    assert provider_mentions('"""Docs may say oneDNN."""\nx = 1  # and comments: onednn\n',
                             words) == []
    assert provider_mentions('x = "hgrt.onednn.conv2d"\n', words) == ["1: 'hgrt.onednn.conv2d'"]
    assert provider_mentions('import hgrt.providers.onednn.kernels\n', words) == [
        "1: 'hgrt.providers.onednn.kernels'"]
    assert provider_mentions('def f(a):\n    return f"{a} dnnl"\n', words) == ["2: ' dnnl'"]


def test_providers_are_reached_only_through_the_registry():
    """A provider's modules import no other provider's (declarations aside); nothing outside a
    provider's folder imports its modules but its declaration (the registry finds the rest by
    name)."""
    bad = []
    for src, dsts in import_graph().items():
        for dst in sorted(dsts):
            owner = provider_of(dst)
            if owner is None or is_declaration(dst) or provider_of(src) == owner:
                continue
            bad.append(f"{src} imports {dst}")
    assert bad == []


def test_every_registered_provider_has_its_folder_and_its_passes_there():
    from hgrt import providers

    modules = product_modules()
    for p in providers.registered():
        assert f"{PROVIDERS}.{p.name}" in modules, f"provider {p.name!r} has no folder"
        assert p.runtime is None or provider_of(p.runtime) == p.name
        for _slot, ref in p.passes:
            assert provider_of(ref.partition(":")[0]) == p.name, ref


def test_the_provider_pass_rule_can_fail():
    good = [("claim_x", "hgrt.providers.x.claim_x")]
    assert pass_file_problems(good, []) == []
    assert pass_file_problems([("claim_x", "hgrt.providers.x.passes")], []) == [
        "pass 'claim_x' is defined in hgrt.providers.x.passes, not in hgrt.providers.x.claim_x"]
