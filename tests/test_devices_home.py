"""Device identity has one home, the package hgrt/devices/, kept by a scan of the product's source.

Outside that package no code reads or compares DLPack device types (``dlpack_device_type()``,
``KDL_*`` codes, ``device_type == 1``, sets of codes), writes a device name by hand
(``f"{kind}:{index}"``, ``f"cpu:{i}"``), splits a device string (``devices.split(",")``,
``name.split(":")``), lists device kinds by name (``("cpu", "cuda", "rocm")``) or defines a
function of the device vocabulary again (``normalize_devices``). The scan reads the syntax tree,
so docstrings and comments may still say ``cpu:{i}``.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("hgrt", "relay_passes", "runtime", "rpc")  # the product (tests and python/ are not)
HOME = os.path.join("hgrt", "devices")  # identity.py, targets.py, host_cpu.py
KIND_NAMES = {"cpu", "cuda", "gpu", "rocm", "opencl", "vulkan", "metal", "cuda_host"}
DEVICE_WORDS = ("dev", "kind")  # what a variable holding a device name is called
INDEX_WORDS = ("index", "device_id", "did")


def _is_int(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _ints(node: ast.AST) -> bool:
    """An int, or a literal tuple / list / set of ints."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_int(e) for e in node.elts)
    return _is_int(node)


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _mentions(node: ast.AST, words: tuple[str, ...]) -> bool:
    return any(w in name.lower() for name in _names(node) for w in words)


def leaks_in_source(source: str, path: str = "<source>",
                    vocabulary: frozenset[str] = frozenset()) -> list[str]:
    """Where ``source`` handles device identity itself; ``vocabulary``: the public functions of
    hgrt/devices/, which no other module defines again."""
    found = []

    def leak(node: ast.AST, what: str) -> None:
        code = (ast.get_source_segment(source, node) or "").splitlines()[0]
        found.append(f"{path}:{node.lineno}: {what}: {code}")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "dlpack_device_type":
            leak(node, "reads a DLPack device type")
        elif isinstance(node, (ast.Name, ast.Attribute)) and \
                (node.id if isinstance(node, ast.Name) else node.attr).upper().startswith("KDL"):
            leak(node, "names a DLPack device code")
        elif isinstance(node, ast.Compare) and _mentions(node, ("device_type", "dl_type")) \
                and any(_ints(side) for side in [node.left, *node.comparators]):
            leak(node, "compares a DLPack device type with a number")
        elif isinstance(node, ast.Assign) and _ints(node.value) \
                and not _is_int(node.value) and _mentions(node.targets[0], ("device",)):
            leak(node, "lists DLPack device codes")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                isinstance(e, ast.Constant) and e.value in KIND_NAMES for e in node.elts):
            leak(node, "lists device kinds by name")
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for j, part in enumerate(parts[:-1]):
                nxt = parts[j + 1]
                if not isinstance(nxt, ast.FormattedValue) or not isinstance(part, ast.Constant):
                    continue
                before = parts[j - 1] if j else None
                by_kind = part.value == ":" and isinstance(before, ast.FormattedValue) and (
                    _mentions(before.value, ("kind",)) or _mentions(nxt.value, INDEX_WORDS))
                literal = any(part.value.lower().endswith(f"{k}:") for k in KIND_NAMES)
                if by_kind or literal:
                    leak(node, "formats a device name by hand")
                    break
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("split", "rsplit", "partition", "rpartition") \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in (",", ":") and _mentions(node.func.value, DEVICE_WORDS):
            leak(node, "splits a device string")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node in tree.body and node.name in vocabulary:
            leak(node, f"defines {node.name}, a function of hgrt/devices/, again")
    return found


def _python_files(folder: str) -> list[str]:
    """The .py files under ``folder``, sub-packages included, sorted."""
    found = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.join(here, f) for f in sorted(files) if f.endswith(".py")]
    return found


def vocabulary(root: str = ROOT) -> frozenset[str]:
    """The public functions of hgrt/devices/."""
    names = set()
    for path in _python_files(os.path.join(root, HOME)):
        with open(path) as f:
            tree = ast.parse(f.read())
        names |= {n.name for n in tree.body
                  if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    return frozenset(names)


def leaks(root: str = ROOT) -> list[str]:
    """Every place of the product, outside hgrt/devices/, that handles device identity."""
    words = vocabulary(root)
    found = []
    for folder in FOLDERS:
        for path in _python_files(os.path.join(root, folder)):
            rel = os.path.relpath(path, root)
            if not rel.startswith(HOME + os.sep):
                with open(path) as f:
                    found += leaks_in_source(f.read(), rel, words)
    return found


def test_device_identity_lives_in_hgrt_devices():
    assert leaks() == []


def test_the_scan_reads_sub_packages_and_knows_the_home():
    scanned = {os.path.relpath(p, ROOT)
               for f in FOLDERS for p in _python_files(os.path.join(ROOT, f))}
    assert os.path.join("relay_passes", "util", "relax_util.py") in scanned
    assert {"split_device", "parse_devices", "host_target"} <= vocabulary()


def test_the_scan_finds_each_kind_of_leak():
    bad = {
        "if dev.dlpack_device_type() == 1: pass": "reads a DLPack device type",
        "on_cpu = device.device_type == 1": "compares a DLPack device type",
        "KDL_CPU = 1": "names a DLPack device code",
        "POINTER_ARITHMETIC_DEVICES = {1, 2, 3, 10}": "lists DLPack device codes",
        "POINTER_DEVICES = ('cpu', 'cuda', 'rocm')": "lists device kinds by name",
        "name = f'{kind}:{index}'": "formats a device name by hand",
        "names = [f'{hdev.kind_of(d).name}:{d.index}' for d in devs]":
            "formats a device name by hand",
        "name = f'cpu:{i % n}'": "formats a device name by hand",
        "devs = [d for d in devices.split(',') if d.strip()]": "splits a device string",
        "kind = names[dev].split(':')[0]": "splits a device string",
        "def normalize_devices(devices):\n    return list(devices)": "defines normalize_devices",
    }
    for source, what in bad.items():
        found = leaks_in_source(source, vocabulary=frozenset({"normalize_devices"}))
        assert any(what in f for f in found), (source, found)
    fine = ["address = f'{host}:{port}'", "msg = f'on {dev}: {cause}'",
            "dims = [int(d) for d in dims.split(',')]", "host, _, port = address.rpartition(':')",
            "'''op i on ``cpu:{i % n}``'''", "targets = ('llvm', 'c')"]
    for source in fine:
        assert leaks_in_source(source) == [], source
