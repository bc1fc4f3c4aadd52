"""Artifacts on disk: ``graph.json`` + ``lib.so`` + ``params.bin`` in one directory (the format;
``hgrt.load`` in hgrt/api.py puts them onto devices)."""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import tvm

from hgrt.errors import HgrtError, ParamError

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


def save(directory: str, graph_json: Any, lib=None, params=None) -> str:
    """Write ``graph.json``, ``lib.so`` and ``params.bin`` into ``directory``.

    ``graph_json`` may also be a build result (anything with ``graph_json``, ``lib`` and
    ``params`` attributes): ``hgrt.save("out/", hgrt.build(...))``.
    """
    if hasattr(graph_json, "graph_json") and lib is None:
        art = graph_json
        graph_json, lib, params = art.graph_json, art.lib, art.params
    if lib is None:
        raise ArtifactError("save: no library given")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, GRAPH_FILE), "w") as f:
        f.write(graph_json if isinstance(graph_json, str) else graph_json.to_json())
    lib.export_library(os.path.join(directory, LIB_FILE))
    with open(os.path.join(directory, PARAMS_FILE), "wb") as f:
        f.write(params_to_bytes(params))
    return directory


def paths(directory: str) -> dict[str, str]:
    """File name -> path of each artifact in ``directory``; an ArtifactError if one is missing."""
    found = {n: os.path.join(directory, n) for n in (GRAPH_FILE, LIB_FILE, PARAMS_FILE)}
    for name, path in found.items():
        if not os.path.exists(path):
            present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise ArtifactError(f"{directory!r} has no {name} (holds {present}); "
                                f"write one with hgrt.save or `hgrt compile`")
    return found


def read(directory: str) -> tuple[str, str, bytes]:
    """``(graph_json, lib_path, params_bytes)`` of an artifact directory."""
    found = paths(directory)
    with open(found[GRAPH_FILE]) as f:
        graph_json = f.read()
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
