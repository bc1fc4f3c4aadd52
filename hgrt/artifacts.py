"""Artifacts on disk: ``graph.json`` + ``lib.so`` + ``params.bin`` in one directory (the format;
``hgrt.load`` in hgrt/api.py puts them onto devices)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm

from hgrt.errors import HgrtError, ParamError

GRAPH_FILE = "graph.json"
LIB_FILE = "lib.so"
PARAMS_FILE = "params.bin"


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


def read(directory: str) -> tuple[str, str, bytes]:
    """``(graph_json, lib_path, params_bytes)`` of an artifact directory."""
    paths = {n: os.path.join(directory, n) for n in (GRAPH_FILE, LIB_FILE, PARAMS_FILE)}
    for name, path in paths.items():
        if not os.path.exists(path):
            present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
            raise ArtifactError(f"{directory!r} has no {name} (holds {present}); "
                                f"write one with hgrt.save or `hgrt compile`")
    with open(paths[GRAPH_FILE]) as f:
        graph_json = f.read()
    with open(paths[PARAMS_FILE], "rb") as f:
        params = f.read()
    return graph_json, paths[LIB_FILE], params


def load_library(path: str) -> tvm.runtime.Module:
    """Load a compiled library on this machine."""
    try:
        return tvm.runtime.load_module(path)
    except Exception as e:
        raise ArtifactError(f"cannot load {path}: {e}") from e
