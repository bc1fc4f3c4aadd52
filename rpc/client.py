"""The client side: ``create_remote`` -> RemoteGraphModule, a GraphModule that runs in a server.

``hgrt.create(graph_json, lib, [remote.cpu(0), remote.cpu(1)])`` lands here. The graph JSON,
the remote library and the devices are sent once; the server builds the executor and returns
its methods. Each method is fetched once, so every API call afterwards (``run``, ``set_input``,
``get_output``, ...) is exactly one round trip; the graph's shapes and names are known here, so
``get_input_info`` and friends cost none.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm

import hgrt.errors as errors
from hgrt.artifacts import params_to_bytes
from hgrt.errors import DeviceError, HgrtError, InputError, ParamError, RemoteError
from hgrt.graph import Graph
from hgrt.rpc import session as sessions
from hgrt.rpc.server import CREATE_FUNC, ERROR_TAG, is_registered, register
from hgrt.rpc.session import connect, describe, upload
from hgrt.runtime.executor import (
    BenchmarkResult,
    checked_value,
    input_items,
    normalize_devices,
    resolve_input,
)

__all__ = ["RemoteGraphModule", "connect", "create_remote", "load_remote", "upload"]

_TAGGED = re.compile(re.escape(ERROR_TAG) + r"(\w+)\] (.*)", re.DOTALL)


def is_remote(obj: Any) -> bool:
    """Whether a Device or Tensor belongs to an RPC session."""
    dev = obj.device if isinstance(obj, tvm.runtime.Tensor) else obj
    return isinstance(dev, tvm.runtime.Device) and \
        dev.dlpack_device_type() >= tvm.rpc.base.RPC_SESS_MASK


def _session_of(devices: list, lib) -> tuple[tvm.rpc.RPCSession, int]:
    """The one RPC session all ``devices`` (and ``lib``, if remote) belong to."""
    local = [str(d) for d in devices if not is_remote(d)]
    if local:
        raise DeviceError(f"cannot mix local and remote devices: {local} are local, "
                          f"{[_dev_name(d) for d in devices if is_remote(d)]} are remote; "
                          f"run on devices of one RPC session (remote.cpu(0), remote.cuda(0))")
    indices = {sessions.session_index(d) for d in devices}
    if len(indices) > 1:
        by = ", ".join(f"{_dev_name(d)} in {describe(sessions.session_index(d))}" for d in devices)
        raise DeviceError(f"all devices must belong to one RPC session: {by}")
    index = indices.pop()
    sess = next((d._rpc_sess for d in devices if getattr(d, "_rpc_sess", None) is not None),
                None) or sessions.find_session(index)
    if sess is None:
        raise DeviceError(f"cannot find the RPC session of {_dev_name(devices[0])}: make remote "
                          f"devices with the session (remote.cpu(0)), or open it with "
                          f"hgrt.rpc.connect")
    if isinstance(lib, tvm.runtime.Module) and lib.kind == "rpc":
        lib_index = sessions.session_index(lib)
        if lib_index != index:
            raise DeviceError(f"the library belongs to {describe(lib_index)} but the devices "
                              f"to {describe(index)}: upload it to the devices' session")
    return sess, index


def _dev_name(dev) -> str:
    if not is_remote(dev):
        return str(dev)
    local = tvm.runtime.Device(dev.dlpack_device_type() % tvm.rpc.base.RPC_SESS_MASK, dev.index)
    return f"remote {local} (session {sessions.session_index(dev)})"


def _graph_text(graph_json: Any) -> str:
    if isinstance(graph_json, Graph):
        return graph_json.to_json()
    if isinstance(graph_json, (bytes, bytearray)):
        return bytes(graph_json).decode()
    if isinstance(graph_json, Mapping):
        return json.dumps(graph_json)
    if isinstance(graph_json, str):
        return graph_json
    raise errors.GraphError(f"graph_json must be a JSON string, bytes, dict or Graph, got "
                            f"{type(graph_json).__name__}")


def _remote_lib(sess: tvm.rpc.RPCSession, lib):
    """A module living on the server: uploaded from a path or exported from a local module."""
    if isinstance(lib, tvm.runtime.Module) and lib.kind == "rpc":
        return lib
    if isinstance(lib, (str, os.PathLike)):
        return upload(sess, os.fspath(lib))
    if isinstance(lib, tvm.runtime.Module):
        with tempfile.TemporaryDirectory(prefix="hgrt_rpc_") as tmp:
            path = os.path.join(tmp, "lib.so")
            lib.export_library(path)
            return upload(sess, path)
    raise RemoteError(f"lib must be a remote module (hgrt.rpc.upload), a path to a .so or a "
                      f"local module, got {type(lib).__name__}")


class _Session:
    """Turns failures of remote calls into hgrt errors that name the session."""

    def __init__(self, sess: tvm.rpc.RPCSession, index: int):
        self.sess = sess
        self.index = index
        self.name = describe(sess)
        self.lost: str | None = None  # why the connection is gone, once it is

    def error(self, e: BaseException, what: str) -> HgrtError:
        m = _TAGGED.search(str(e))
        if m is not None:
            cls = getattr(errors, m.group(1), None)
            if not (isinstance(cls, type) and issubclass(cls, HgrtError)):
                cls = RemoteError
            msg = m.group(2).strip()
            return cls(f"{msg} (in {self.name})" if cls is RemoteError else msg)
        # Not raised by hgrt's server code: the connection itself failed.
        self.lost = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        return RemoteError(f"{self.name}: {what} failed, the server is unreachable or died "
                           f"({self.lost})")

    def check(self, what: str) -> None:
        if self.lost is not None:
            raise RemoteError(f"{self.name}: cannot {what}, the session was lost earlier "
                              f"({self.lost}); connect again")


class RemoteGraphModule:
    """A GraphModule that lives in an RPC server; the same API, one round trip per call.

    >>> remote = hgrt.rpc.connect(tracker="10.0.0.1:9190", key="jetson")  # doctest: +SKIP
    >>> m = hgrt.create(graph_json, hgrt.rpc.upload(remote, "out/lib.so"),
    ...                 [remote.cpu(0), remote.cuda(0)])                   # doctest: +SKIP
    >>> m.set_input("x", x); m.run(); y = m.get_output(0).numpy()          # doctest: +SKIP
    """

    def __init__(self, graph_json: str, lib, devices: list, session: _Session, method):
        self.graph_json = graph_json
        self.lib = lib
        self.devices = devices
        self.session = session
        self._method = method
        self._methods: dict[str, Any] = {}
        info = json.loads(self._call("info"))
        self._id = info["id"]
        self._inputs = info["inputs"]
        self._outputs = info["outputs"]
        self._params = info["params"]
        self._num_inputs = info["num_inputs"]
        self._device_bytes = info["device_bytes"]
        self._server_repr = info["repr"]
        self._arg_index = {inp["name"]: i for i, inp in enumerate(self._inputs)}
        self._run = self._fetch("run")
        self._graph: Graph | None = None

    # ---- plumbing -------------------------------------------------------------------------
    def _fetch(self, name: str):
        f = self._methods.get(name)
        if f is None:
            self.session.check(f"call {name}")
            try:
                f = self._methods[name] = self._method(name)
            except Exception as e:
                raise self.session.error(e, f"fetching method {name!r}") from e
        return f

    def _call(self, name: str, *args):
        if self.session.lost is not None:
            self.session.check(f"call {name}")
        f = self._methods.get(name) or self._fetch(name)
        try:
            return f(*args)
        except Exception as e:
            raise self.session.error(e, name) from e

    @property
    def graph(self) -> Graph:
        """The graph, parsed here on first use (the server holds its own copy)."""
        if self._graph is None:
            self._graph = Graph.from_json(self.graph_json)
        return self._graph

    # ---- running --------------------------------------------------------------------------
    def run(self, **inputs) -> None:
        """Run the graph once in the server: one round trip (plus one to send ``inputs``)."""
        if inputs:
            self.set_input(**inputs)
        if self.session.lost is not None:
            self.session.check("run")
        try:
            self._run()
        except Exception as e:
            raise self.session.error(e, "run") from e

    def benchmark(self, repeat: int = 5, number: int = 10, warmup: int = 1) -> BenchmarkResult:
        """Time ``run()`` in the server (no network in the figures): seconds per run."""
        return BenchmarkResult(tuple(json.loads(self._call("benchmark", int(repeat),
                                                           int(number), int(warmup)))))

    # ---- inputs ---------------------------------------------------------------------------
    def get_input_index(self, name: str) -> int:
        return self._arg_index.get(name, -1)

    def get_num_inputs(self) -> int:
        return self._num_inputs

    def get_num_outputs(self) -> int:
        return len(self._outputs)

    def get_input_info(self) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
        shapes, dtypes = {}, {}
        for inp in self._inputs:
            if not inp["param"]:
                shapes[inp["name"]] = tuple(inp["shape"])
                dtypes[inp["name"]] = inp["dtype"]
        return shapes, dtypes

    def _resolve_input(self, key: int | str) -> int:
        return resolve_input(key, self._arg_index)

    def set_input(self, key: int | str | Mapping | None = None, value: Any = None,
                  **inputs) -> None:
        """Like GraphModule.set_input: numpy arrays (sent as bytes, one round trip each), local
        tensors, or tensors of the same session (copied in the server, nothing downloaded)."""
        for idx, val in input_items(key, value, inputs, self._resolve_input):
            self._set_one(idx, val)

    def _set_one(self, idx: int, value: Any, what: str = "input") -> None:
        inp = self._inputs[idx]
        value = checked_value(value, inp["shape"], inp["dtype"], f"{what} {inp['name']!r}")
        if isinstance(value, tvm.runtime.Tensor) and is_remote(value):
            self._check_same_session(value, f"{what} {inp['name']!r}")
            self._call("set_input_tensor", idx, value)
            return
        if isinstance(value, tvm.runtime.Tensor):
            value = value.numpy()
        self._call("set_input_bytes", idx, np.ascontiguousarray(value).tobytes())

    def _check_same_session(self, tensor, what: str) -> None:
        index = sessions.session_index(tensor.device)
        if index != self.session.index:
            raise DeviceError(f"{what}: the tensor is on {_dev_name(tensor.device)}, not in "
                              f"{self.session.name}")

    def get_input(self, key: int | str, out=None):
        """The remote tensor holding input ``key``; copied into ``out`` (remote or local)."""
        idx = self._resolve_input(key)
        inp = self._inputs[idx]
        return self._fetch_tensor("input", idx, inp["shape"], inp["dtype"], out, f"input {key!r}")

    # ---- outputs --------------------------------------------------------------------------
    def get_output(self, index: int, out=None):
        """The remote tensor of output ``index`` (valid until the next run); with ``out`` (a
        tensor of this session, or a local one) the output is copied there instead."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) \
                or not 0 <= index < len(self._outputs):
            raise InputError(f"output index {index!r} out of range: the graph has "
                             f"{len(self._outputs)} outputs")
        o = self._outputs[index]
        return self._fetch_tensor("output", int(index), o["shape"], o["dtype"], out,
                                  f"output {index}")

    def _fetch_tensor(self, kind: str, idx: int, shape, dtype: str, out, what: str):
        if out is None:
            return self._call(f"get_{kind}", idx)
        if not isinstance(out, tvm.runtime.Tensor):
            raise InputError(f"{what}: out must be a tvm Tensor, got {type(out).__name__}")
        if tuple(out.shape) != tuple(shape) or str(out.dtype) != dtype:
            raise InputError(f"{what}: out is {tuple(out.shape)} {out.dtype}, expected "
                             f"{tuple(shape)} {dtype}")
        if is_remote(out):
            self._check_same_session(out, f"{what}: out")
            self._call(f"get_{kind}_into", idx, out)
        else:
            data = self._call(f"get_{kind}_bytes", idx)
            out.copyfrom(np.frombuffer(data, dtype=dtype).reshape(tuple(shape)))
        return out

    # ---- params ---------------------------------------------------------------------------
    def load_params(self, params: bytes | bytearray | Mapping, strict: bool = True) -> None:
        """Params as ``save_param_dict`` bytes or a dict of arrays; sent in one round trip."""
        if isinstance(params, Mapping):
            params = {k: v.numpy() if isinstance(v, tvm.runtime.Tensor) and is_remote(v) else v
                      for k, v in params.items()}
        elif not isinstance(params, (bytes, bytearray)):
            raise ParamError(f"params must be bytes or a dict of arrays, got "
                             f"{type(params).__name__}")
        self._call("load_params", params_to_bytes(params), bool(strict))

    def share_params(self, other: RemoteGraphModule, params: bytes | Mapping | None = None) -> None:
        """Read ``other``'s parameter tensors (no copy); both modules must be in one session."""
        if not isinstance(other, RemoteGraphModule):
            raise ParamError(f"share_params: a remote module can only share with another remote "
                             f"module of {self.session.name}, got {type(other).__name__}")
        if other.session.index != self.session.index:
            raise ParamError(f"share_params: the other module is in {other.session.name}, this "
                             f"one in {self.session.name}")
        names = None
        if params is not None:
            names = list(tvm.runtime.load_param_dict(bytes(params))) \
                if isinstance(params, (bytes, bytearray)) else list(params)
        self._call("share_params", other._id, json.dumps(names))

    # ---- introspection --------------------------------------------------------------------
    @property
    def device_bytes(self) -> list[int]:
        return list(self._device_bytes)

    def __repr__(self) -> str:
        return f"Remote{self._server_repr} in {self.session.name}"


def create_remote(graph_json: Any, lib, devices) -> RemoteGraphModule:
    """Create the executor inside the RPC server that ``devices`` belong to.

    ``lib`` is a module of that session (``hgrt.rpc.upload``), a path to a local ``.so``
    (uploaded) or a local module (exported, then uploaded). ``hgrt.create`` calls this when
    its devices are remote.

    >>> m = create_remote(graph_json, lib, [remote.cpu(0), remote.cpu(1)])  # doctest: +SKIP
    """
    devs = normalize_devices(devices)
    sess, index = _session_of(devs, lib)
    if isinstance(sess, tvm.rpc.LocalSession) and not is_registered():
        register()  # a LocalSession serves from this very process
    session = _Session(sess, index)
    session.check("create a module")
    try:
        remote_create = sess.get_function(CREATE_FUNC)
    except AttributeError:
        raise RemoteError(f"the server of {session.name} does not serve hgrt (it has no "
                          f"function {CREATE_FUNC!r}): start it with `hgrt rpc-server`, or call "
                          f"hgrt.rpc.server.register() in its server_init_callback") from None
    except Exception as e:
        raise session.error(e, "looking up hgrt on the server") from e
    rlib = _remote_lib(sess, lib)
    text = _graph_text(graph_json)
    try:
        method = remote_create(text, rlib, *devs)
    except Exception as e:
        raise session.error(e, "create") from e
    return RemoteGraphModule(text, rlib, devs, session, method)


def load_remote(directory: str, remote: tvm.rpc.RPCSession, devices=None) -> RemoteGraphModule:
    """The artifacts in ``directory`` (graph.json, lib.so, params.bin) run in ``remote``.

    ``devices`` defaults to ``[remote.cpu(0)]``; strings such as ``"cpu:0"`` / ``"cuda"``
    name devices of the session.
    """
    from hgrt.artifacts import read

    graph_json, lib_path, params = read(directory)
    devs = remote_devices(remote, devices)
    m = create_remote(graph_json, upload(remote, lib_path), devs)
    m.load_params(params)
    return m


def remote_devices(remote: tvm.rpc.RPCSession, devices=None) -> list:
    """``["cpu:0", "cuda"]`` (or ``"cpu:0,cuda:0"``, or local Devices) -> devices of ``remote``."""
    from hgrt.devices import parse_device

    if devices is None:
        return [remote.cpu(0)]
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()]
    out = []
    for d in devices:
        if isinstance(d, tvm.runtime.Device):
            out.append(d if is_remote(d) else remote.device(d.dlpack_device_type(), d.index))
        else:
            out.append(parse_device(d, remote))
    return out
