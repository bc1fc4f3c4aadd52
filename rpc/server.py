"""The server side of remote execution: hgrt's functions inside a TVM RPC server.

A client calls ``hgrt.remote.create(graph_json, lib, *devices)`` once; the server builds an
ordinary :class:`~hgrt.runtime.executor.GraphModule` there and hands back one function,
``method(name) -> Function``. The client fetches each method it uses once, so every later API
call (``run``, ``set_input``, ...) is exactly one round trip, and ``run()`` never crosses the
wire per op.

What crosses RPC (see TVM027_NOTES "RPC"): str, bytes, scalars, Devices, remote tensors and
modules. So configuration and results travel as JSON strings, numpy data as bytes, and every
tensor the client sends is copied before the call returns (it is a non-owning view).

Errors: an ``HgrtError`` raised here reaches the client as the same class. TVM turns a Python
exception in a remote function into a plain RuntimeError carrying the message, so the class
name is put in the message (``[hgrt:GraphError] ...``) and the client raises it again.
"""

from __future__ import annotations

import itertools
import json
import platform
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
import tvm_ffi

import hgrt.errors as errors
from hgrt.errors import HgrtError, InputError, ParamError
from hgrt.rpc.views import rpc_safe_view
from hgrt.runtime.executor import GraphModule, create

CREATE_FUNC = "hgrt.remote.create"
PLATFORM_FUNC = "hgrt.remote.platform"
PING_FUNC = "hgrt.remote.ping"
ERROR_TAG = "[hgrt:"  # "[hgrt:GraphError] message": the class travels in the message

# Server-side modules by id, for share_params between two modules of one session.
_MODULES: weakref.WeakValueDictionary[int, RemoteModuleServer] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_REGISTER_LOCK = threading.Lock()


def encode_error(e: BaseException) -> str:
    """The message that carries ``e``'s hgrt class across RPC."""
    name = type(e).__name__ if isinstance(e, HgrtError) else "RemoteError"
    for cls in type(e).__mro__:  # a subclass defined elsewhere travels as its hgrt base
        if cls.__module__ == errors.__name__ and issubclass(cls, HgrtError):
            name = cls.__name__
            break
    detail = str(e) if isinstance(e, HgrtError) else f"{type(e).__name__}: {e}"
    return f"{ERROR_TAG}{name}] {detail}"


def _remote_call(func: Callable) -> Callable:
    """Wrap a server method so that any exception reaches the client as a tagged message."""

    def call(*args):
        try:
            return func(*args)
        except Exception as e:  # noqa: BLE001 - every failure must reach the client, typed
            raise RuntimeError(encode_error(e)) from e

    call.__name__ = func.__name__
    return call


class RemoteModuleServer:
    """A GraphModule living in the server, with the methods the client calls.

    Every method takes and returns only what crosses RPC. Tensors passed in are copied
    (``set_input``/``load_params`` copy into the module's own storage, ``get_output(i, out)``
    copies into ``out``); nothing keeps a reference to a caller's tensor.
    """

    METHODS = ("info", "run", "set_input_bytes", "set_input_tensor", "get_input",
               "get_input_bytes", "get_input_into", "get_output", "get_output_bytes",
               "get_output_into", "load_params", "share_params", "benchmark")

    def __init__(self, module: GraphModule):
        self.module = module
        self.id = next(_IDS)
        _MODULES[self.id] = self
        self._methods = {name: tvm_ffi.convert(_remote_call(getattr(self, name)))
                         for name in self.METHODS}
        self._returned: dict[tuple[str, int], Any] = {}  # views handed out, made once

    def _returnable(self, kind: str, index: int, tensor):
        # RPC loses byte_offset: hand out a pointer-moved view that owns its buffer.
        key = (kind, index)
        view = self._returned.get(key)
        if view is None:
            view = self._returned[key] = rpc_safe_view(tensor)
        return view

    def method(self, name: str):
        f = self._methods.get(name)
        if f is None:
            raise HgrtError(f"remote module: method {errors.did_you_mean(name, self.METHODS)}")
        return f

    # ---- description (one round trip at create time) ------------------------------------
    def info(self) -> str:
        m, g = self.module, self.module.graph
        shapes, dtypes = m.get_input_info()
        inputs = []
        for nid in g.arg_nodes:
            eid = g.entry_id(nid)
            inputs.append({"name": g.nodes[nid].name, "shape": list(g.shapes[eid]),
                           "dtype": g.dtypes[eid], "param": g.nodes[nid].name in g.params})
        outputs = []
        for nid, idx, _ in g.heads:
            eid = g.entry_id(nid, idx)
            outputs.append({"shape": list(g.shapes[eid]), "dtype": g.dtypes[eid],
                            "device_index": g.entry_device(eid)})
        return json.dumps({"id": self.id, "inputs": inputs, "outputs": outputs,
                           "params": list(g.params), "num_inputs": m.get_num_inputs(),
                           "devices": [str(d) for d in m.devices],
                           "device_bytes": m.device_bytes, "repr": repr(m)})

    # ---- running --------------------------------------------------------------------------
    def run(self) -> None:
        self.module.run()

    def benchmark(self, repeat: int, number: int, warmup: int) -> str:
        return json.dumps(self.module.benchmark(repeat, number, warmup).results)

    # ---- inputs ---------------------------------------------------------------------------
    def _input_array(self, index: int, data: bytes) -> np.ndarray:
        g = self.module.graph
        eid = g.entry_id(g.arg_nodes[index])
        shape, dtype = tuple(g.shapes[eid]), g.dtypes[eid]
        want = g.entry_bytes(eid)
        if len(data) != want:
            raise InputError(f"input {g.nodes[g.arg_nodes[index]].name!r}: got {len(data)} "
                             f"bytes, expected {want} ({shape} {dtype})")
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def set_input_bytes(self, index: int, data: bytes) -> None:
        # np.frombuffer views the received bytes; set_input copies them into our storage.
        self.module.set_input(int(index), self._input_array(int(index), data))

    def set_input_tensor(self, index: int, tensor) -> None:
        self.module.set_input(int(index), tensor)  # copies: the tensor is the caller's view

    def get_input(self, index: int):
        return self._returnable("input", int(index), self.module.get_input(int(index)))

    def get_input_bytes(self, index: int) -> bytes:
        return self.module.get_input(int(index)).numpy().tobytes()

    def get_input_into(self, index: int, out) -> None:
        self.module.get_input(int(index), out)

    # ---- outputs --------------------------------------------------------------------------
    def get_output(self, index: int):
        return self._returnable("output", int(index), self.module.get_output(int(index)))

    def get_output_bytes(self, index: int) -> bytes:
        return self.module.get_output(int(index)).numpy().tobytes()

    def get_output_into(self, index: int, out) -> None:
        self.module.get_output(int(index), out)

    # ---- params ---------------------------------------------------------------------------
    def load_params(self, blob: bytes, strict: bool) -> None:
        self.module.load_params(bytes(blob), strict=bool(strict))

    def share_params(self, other_id: int, names_json: str) -> None:
        other = _MODULES.get(int(other_id))
        if other is None:
            raise ParamError(f"share_params: module {other_id} is not alive in this session")
        names = json.loads(names_json)
        params = None if names is None else dict.fromkeys(names)
        self.module.share_params(other.module, params)
        self._returned.clear()  # inputs now live in the other module's storage


def remote_create(graph_json: str, lib, *devices) -> Any:
    """``hgrt.remote.create``: build the executor here and return its method table.

    >>> f = session.get_function("hgrt.remote.create")           # doctest: +SKIP
    >>> method = f(graph_json, remote_lib, session.cpu(0), session.cpu(1))   # doctest: +SKIP
    >>> method("run")()                                          # doctest: +SKIP
    """
    if not isinstance(graph_json, str):
        graph_json = bytes(graph_json).decode()
    module = create(graph_json, lib, list(devices))  # devices arrive without the session mask
    server = RemoteModuleServer(module)
    # The returned function keeps `server` (and its module, storage and lib) alive for as long
    # as the client holds it.
    return tvm_ffi.convert(_remote_call(server.method))


def remote_platform() -> str:
    """``hgrt.remote.platform``: what the server runs on, as JSON (checked before uploads)."""
    return json.dumps({"machine": platform.machine(), "system": platform.system(),
                       "tvm": tvm.__version__, "hgrt": _hgrt_version()})


def remote_ping() -> int:
    """``hgrt.remote.ping``: does nothing; one bare round trip (health checks, benchmarks)."""
    return 0


def _hgrt_version() -> str:
    import hgrt

    return hgrt.__version__


def register(override: bool = True) -> None:
    """Register hgrt's remote functions as TVM global functions in this process.

    A TVM RPC server runs in a PopenWorker subprocess, so call this in its
    ``server_init_callback`` (``serve`` does), or in-process for ``tvm.rpc.LocalSession``.
    """
    with _REGISTER_LOCK:
        tvm_ffi.register_global_func(CREATE_FUNC, _remote_call(remote_create), override=override)
        tvm_ffi.register_global_func(PLATFORM_FUNC, _remote_call(remote_platform),
                                     override=override)
        tvm_ffi.register_global_func(PING_FUNC, remote_ping, override=override)


def is_registered() -> bool:
    return tvm_ffi.get_global_func(CREATE_FUNC, allow_missing=True) is not None


def _server_init() -> None:
    # Runs in the RPC server's PopenWorker (shipped there by cloudpickle, by reference).
    import hgrt.rpc.server

    hgrt.rpc.server.register()


def serve(host: str = "0.0.0.0", port: int = 9090, port_end: int = 9199,
          tracker: str | tuple[str, int] | None = None, key: str = "", *,
          custom_addr: str | None = None, silent: bool = False,
          load_library: str | None = None) -> tvm.rpc.Server:
    """Start a TVM RPC server that also serves hgrt; returns it (``.port``, ``.terminate()``).

    With ``tracker`` ("host:port"), the server registers there under ``key``; without, it is
    standalone and ``key`` is what clients must give to ``tvm.rpc.connect``.

    >>> server = serve("0.0.0.0", 9090, tracker="10.0.0.1:9190", key="jetson")  # doctest: +SKIP
    >>> server.proc.join()                                                      # doctest: +SKIP
    """
    tracker_addr = parse_address(tracker, "tracker") if isinstance(tracker, str) else tracker
    if tracker_addr is not None and not key:
        raise InputError("a server registered with a tracker needs a key (e.g. key='jetson')")
    return tvm.rpc.Server(host, port, port_end, tracker_addr=tracker_addr, key=key,
                          load_library=load_library, custom_addr=custom_addr, silent=silent,
                          server_init_callback=_server_init)


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9190), got {address!r}")
    return host, int(port)
