"""Artifacts on disk: ``graph.json`` + ``lib.so`` + ``params.bin`` in one directory (the format;
``hgrt.load`` in hgrt/api.py puts them onto devices)."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import tvm

from hgrt.devices import is_host_triple, machine_arch
from hgrt.errors import BuildError, GraphError, HgrtError, ParamError

GRAPH_FILE = "graph.json"
LIB_FILE = "lib.so"
PARAMS_FILE = "params.bin"
_LIST_MAGIC = 0xF7E58D4F05049CB7  # TVM's kTVMNDArrayListMagic: a save_param_dict blob
_TENSOR_MAGIC = 0xDD5E40F096B4A13F  # kTVMNDArrayMagic: one tensor in it
_TYPE_CODES = {0: "int", 1: "uint", 2: "float", 6: "bool"}  # DLPack type codes numpy holds


class ArtifactError(HgrtError, FileNotFoundError):
    """An artifact directory is missing a file or holds an unreadable one."""


def params_to_bytes(params: bytes | Mapping | None) -> bytes:
    """Params as TVM's ``save_param_dict`` bytes (numpy arrays and TVM tensors accepted)."""
    if params is None:
        return bytes(tvm.runtime.save_param_dict({}))
    if isinstance(params, (bytes, bytearray)):
        return bytes(params)
    if not isinstance(params, Mapping):
        raise ParamError(f"params must be bytes or a dict, got {type(params).__name__}")
    tensors = {}
    for name, value in params.items():
        if not isinstance(value, tvm.runtime.Tensor):
            value = tvm.runtime.tensor(np.ascontiguousarray(value), tvm.cpu(0))
        tensors[name] = value
    return bytes(tvm.runtime.save_param_dict(tensors))


def save(directory: str, graph_json: Any, lib=None, params=None, *, cc: str | None = None) -> str:
    """Write ``graph.json``, ``lib.so`` and ``params.bin`` into ``directory``.

    ``graph_json`` may also be a build result (anything with ``graph_json``, ``lib`` and
    ``params`` attributes): ``hgrt.save("out/", hgrt.build(...))``.
    ``lib.so`` is linked for the machine its code is for: by this host's compiler, or for
    another architecture by the cross compiler its triple names (``aarch64-linux-gnu-g++``);
    ``cc`` names another compiler (on PATH, or a path). The three files are written into a
    temporary directory beside ``directory`` and moved there only once all are complete: a
    failed save leaves ``directory`` as it was.

    >>> hgrt.save("out/", hgrt.build(model, ["cpu:0", "cpu:1"],
    ...                              target={"cpu": "raspberry-pi/4b-aarch64"}))  # doctest: +SKIP
    """
    if hasattr(graph_json, "graph_json") and lib is None:
        art = graph_json
        graph_json, lib, params = art.graph_json, art.lib, art.params
    if lib is None:
        raise ArtifactError("save: no library given")
    fcompile = link_compiler(lib, cc)
    final = os.path.abspath(directory)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{os.path.dirname(final)}/.{os.path.basename(final)}.partial-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp)
    try:
        with open(os.path.join(tmp, GRAPH_FILE), "w") as f:
            f.write(graph_json if isinstance(graph_json, str) else graph_json.to_json())
        try:
            lib.export_library(os.path.join(tmp, LIB_FILE), fcompile=fcompile)
        except Exception as e:
            raise BuildError(f"save {directory}: linking {LIB_FILE} for "
                             f"{library_triple(lib) or 'this host'} failed: {e}") from e
        with open(os.path.join(tmp, PARAMS_FILE), "wb") as f:
            f.write(params_to_bytes(params))
        if not os.path.isdir(final):
            os.rename(tmp, final)  # the whole directory appears at once
        for name in (GRAPH_FILE, PARAMS_FILE, LIB_FILE):  # (left after a rename: none)
            if os.path.exists(os.path.join(tmp, name)):
                os.replace(os.path.join(tmp, name), os.path.join(final, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def library_triple(lib: tvm.runtime.Module) -> str | None:
    """The LLVM triple of a built library's host code (None: not known, this host's)."""
    try:
        if lib.kind != "llvm":
            return None
        return json.loads(lib.get_function("_get_target_string")()).get("mtriple") or None
    except Exception:  # not a module built here (a loaded .so), or no target string
        return None


def cross_compiler_name(triple: str) -> str:
    """Debian's name of the g++ that links for ``triple``: ``aarch64-unknown-linux-gnu`` ->
    ``aarch64-linux-gnu-g++``, ``armv8l-linux-gnueabihf`` -> ``arm-linux-gnueabihf-g++``."""
    parts = triple.split("-")
    if len(parts) == 4:  # arch-vendor-os-abi: Debian's names have no vendor
        del parts[1]
    if machine_arch(parts[0]) == "arm":
        parts[0] = "arm"
    return "-".join(parts) + "-g++"


def link_compiler(lib: tvm.runtime.Module, cc: str | None = None):
    """The ``fcompile`` that links ``lib``: None (TVM's default: this host's g++) for host
    code, else ``cc`` or the cross compiler of the library's triple, which must exist."""
    triple = library_triple(lib)
    if cc is None:
        if triple is None or is_host_triple(triple):
            return None
        cc = cross_compiler_name(triple)
        if shutil.which(cc) is None:
            raise BuildError(f"linking lib.so for {triple} needs the cross compiler {cc!r}, "
                             f"which is not installed (Debian/Ubuntu: apt-get install "
                             f"g++-{cc.removesuffix('-g++')}); or name one with cc= "
                             f"(`hgrt compile --cc`)")
    elif shutil.which(cc) is None:
        raise BuildError(f"the compiler {cc!r} given to link lib.so is not on PATH")
    return tvm.support.cc.cross_compiler(cc)


def paths(directory: str) -> dict[str, str]:
    """File name -> path of each artifact in ``directory``; an ArtifactError if one is missing."""
    found = {n: os.path.join(directory, n) for n in (GRAPH_FILE, LIB_FILE, PARAMS_FILE)}
    for name, path in found.items():
        if not os.path.exists(path):
            present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise ArtifactError(f"{directory!r} has no {name} (holds {present}); "
                                f"write one with hgrt.save or `hgrt compile`")
    return found


def read_graph_text(path: str) -> str:
    """The text of a graph JSON file; a ``GraphError`` naming it when it is not UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraphError(f"{path}: not a graph JSON (not UTF-8 text: byte {e.start} is "
                         f"{raw[e.start]:#04x})") from None


def read(directory: str) -> tuple[str, str, bytes]:
    """``(graph_json, lib_path, params_bytes)`` of an artifact directory."""
    found = paths(directory)
    graph_json = read_graph_text(found[GRAPH_FILE])
    with open(found[PARAMS_FILE], "rb") as f:
        params = f.read()
    return graph_json, found[LIB_FILE], params


def iter_params(source: str | bytes | Mapping) -> Iterator[tuple[str, Any]]:
    """``(name, array)`` for each param, one at a time. ``source`` is a ``save_param_dict`` file
    (a path), read piecewise so that host memory holds one weight, not all of them; its bytes;
    or a dict (iterated as it is).

    >>> next(iter_params(params_to_bytes({"w": np.ones(2, "float32")})))
    ('w', array([1., 1.], dtype=float32))
    """
    if isinstance(source, Mapping):
        yield from source.items()
        return
    if isinstance(source, (bytes, bytearray)):
        yield from _read_params(io.BytesIO(source), "params blob")
        return
    with open(source, "rb") as f:
        yield from _read_params(f, repr(os.fspath(source)))


def _read_params(f: BinaryIO, where: str) -> Iterator[tuple[str, np.ndarray]]:
    # TVM's layout: list magic, reserved, the names (count, then length + bytes each), then the
    # tensors (count, then each: header, shape, byte count, data), all little-endian.
    magic, _ = _unpack(f, "<QQ", where, "header")
    if magic != _LIST_MAGIC:
        raise ParamError(f"{where} is not in TVM's save_param_dict format (magic {magic:#x})")
    (count,) = _unpack(f, "<Q", where, "header")
    names = [f.read(_unpack(f, "<Q", where, "names")[0]).decode() for _ in range(count)]
    if _unpack(f, "<Q", where, "header")[0] != count:
        raise ParamError(f"{where}: {count} names but another number of tensors")
    for name in names:
        magic, _, _, _, ndim, code, bits, lanes = _unpack(f, "<QQiiiBBH", where, name)
        shape = _unpack(f, f"<{ndim}q", where, name)
        (nbytes,) = _unpack(f, "<Q", where, name)
        if magic != _TENSOR_MAGIC or code not in _TYPE_CODES or lanes != 1:
            raise ParamError(f"{where}: param {name!r} has a header hgrt cannot read (dtype "
                             f"code {code}, {bits} bits, {lanes} lanes)")
        value = np.empty(shape, np.dtype(f"{_TYPE_CODES[code]}{bits if code != 6 else ''}"))
        if value.nbytes != nbytes or f.readinto(value.reshape(-1).view(np.uint8)) != nbytes:
            raise ParamError(f"{where}: param {name!r} {shape} is truncated or mis-sized")
        yield name, value
        del value  # before the next one is read: one weight in host memory at a time


def _unpack(f: BinaryIO, fmt: str, where: str, what: str) -> tuple:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ParamError(f"{where} ends inside the {what!r} record: truncated")
    return struct.unpack(fmt, data)


def load_library(path: str) -> tvm.runtime.Module:
    """Load a compiled library on this machine."""
    try:
        return tvm.runtime.load_module(path)
    except Exception as e:
        raise ArtifactError(f"cannot load {path}: {e}") from e
