"""``hgrt.create`` and ``hgrt.load``: one graph module API, whether the devices are here or in an
RPC server.

>>> m = hgrt.load("out/", [tvm.cpu(0), tvm.cpu(1)])                        # doctest: +SKIP
>>> remote = hgrt.rpc.connect(tracker="10.0.0.1:9190", key="jetson")      # doctest: +SKIP
>>> m = hgrt.load("out/", ["cpu:0", "cuda:0"], session=remote)           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from hgrt import artifacts
from hgrt import devices as hdev
from hgrt.errors import DeviceError, HgrtError, ParamError
from hgrt.graph import Graph
from hgrt.rpc.client import create_remote_on
from hgrt.runtime import executor
from hgrt.runtime.module_api import GraphModuleAPI

REMOTE_BATCH_BYTES = 64 << 20  # weights sent to a server per round trip by create_loaded


def create(graph_json: str | bytes | dict | Graph, lib, devices) -> GraphModuleAPI:
    """A module that runs ``graph_json`` with kernels from ``lib`` on ``devices``.

    ``devices[i]`` holds the entries whose ``device_index`` is ``i`` (without that column,
    everything runs on ``devices[0]``). Local devices give a ``GraphModule``; devices of one TVM
    RPC session give a ``RemoteGraphModule`` whose executor runs in that server (``lib`` is then
    a module of the session, or a path to a library, uploaded and never loaded here).
    """
    devs = hdev.normalize_devices(devices)
    if any(hdev.is_remote(d) for d in devs):
        return create_remote_on(graph_json, lib, devs)
    return executor.create_on(graph_json, lib, devs)


def devices_for(graph: Graph | None, devices: Any = None, session: Any = None) -> list:
    """The runtime devices for ``graph``: tvm Devices as given, names (``"cpu:1"``, or one
    string ``"cpu:0,cuda:0"``) of this machine or of ``session``; by default the devices the
    graph was built for (``cpu:0`` without a graph)."""
    names = hdev.device_list(devices) or (graph and graph.device_names) or ["cpu:0"]
    return [hdev.runtime_device(d, session) for d in names]


def load(directory: str, devices: Any = None, *, session: Any = None) -> GraphModuleAPI:
    """The module for the artifacts in ``directory`` (graph.json, lib.so, params.bin), params
    loaded. ``devices`` as in ``devices_for``; with an RPC ``session`` (or remote devices) the
    library is uploaded by path, so a library built for the server's architecture loads there
    and is never loaded on this machine."""
    found = artifacts.paths(directory)
    graph = Graph.from_json(artifacts.read_graph_text(found[artifacts.GRAPH_FILE]))
    devs = devices_for(graph, devices, session)
    remote = [hdev.is_remote(d) for d in devs]
    if any(remote) and not all(remote):
        raise DeviceError(f"cannot mix local and remote devices: "
                          f"{[hdev.device_name(d) for d in devs]}")
    # a local library is loaded once its CPU is checked
    return create_loaded(graph, found[artifacts.LIB_FILE], devs, found[artifacts.PARAMS_FILE])


def create_loaded(graph: Graph, lib: Any, devices: list, params: Any) -> GraphModuleAPI:
    """``create``, then every weight of ``params`` (a params.bin path, its bytes, or a dict)
    loaded one at a time, so that host memory holds one weight, not all of them (for a server:
    one batch of up to ``REMOTE_BATCH_BYTES`` per round trip). A weight that fails, or one the
    params lack, closes the module again before the error is raised."""
    module = create(graph, lib, devices)
    limit = REMOTE_BATCH_BYTES if any(hdev.is_remote(d) for d in devices) else 0
    try:
        loaded, batch, size = set(), {}, 0
        with contextlib.closing(artifacts.iter_params(params)) as weights:
            for name, value in weights:
                batch[name] = value
                size += getattr(value, "nbytes", 0)
                del value  # the next weight is read while none is held here but in the batch
                if size >= limit:
                    module.load_params(batch)
                    loaded.update(batch)
                    batch, size = {}, 0
        if batch:
            module.load_params(batch)
            loaded.update(batch)
        missing = sorted(set(graph.params) - loaded)
        if missing:
            raise ParamError(f"the params have no value for weights {missing}")
    except BaseException:
        try:
            module.close()
        except HgrtError as e:  # the error that stopped the load is the one to see
            logging.getLogger("hgrt").warning("closing the module after a failed load: %s", e)
        raise
    return module
