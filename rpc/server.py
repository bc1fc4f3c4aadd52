"""The server side of remote execution: hgrt's functions inside a TVM RPC server.

A client calls ``hgrt.remote.create(graph_json, lib, *devices)`` once; the server builds an
ordinary :class:`~hgrt.runtime.executor.GraphModule` there and hands back one function,
``method(name) -> Function``. The client fetches each method it uses once, so every later API
call (``run``, ``set_input``, ...) is exactly one round trip, and ``run()`` never crosses the
wire per op. What crosses, and how errors do, is hgrt.rpc.protocol; the bytes hgrt lays out
itself (a stage's spec and reply, the inbox's frames) are hgrt.rpc.wire. Every tensor the client
sends is copied before the call returns (it is a non-owning view).
"""

from __future__ import annotations

import functools
import gc
import importlib.metadata
import itertools
import json
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partialmethod
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from hgrt.errors import ClosedError, GraphError, HgrtError, InputError, ParamError, did_you_mean
from hgrt.rpc import channel, wire
from hgrt.rpc.listen import ListenConfig, RPCServer, parse_allow
from hgrt.rpc.protocol import (
    CREATE_FUNC,
    INBOX_FUNC,
    METHODS,
    OUTBOX_CLOSE_FUNC,
    OUTBOX_FUNC,
    PING_FUNC,
    PLATFORM_FUNC,
    STATS_FUNC,
    encode_error,
    parse_address,
)
from hgrt.runtime.executor import GraphModule, create
from hgrt.runtime.module_api import benchmark_args
from hgrt.runtime.views import pointer_view

# Server-side modules by id, for share_params between two modules of one session.
_MODULES: weakref.WeakValueDictionary[int, RemoteModuleServer] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)
_REGISTER_LOCK = threading.Lock()


def _remote_call(func: Callable) -> Callable:
    """Wrap a server method so that any exception reaches the client as a tagged message."""

    def call(*args):
        try:
            return func(*args)
        except Exception as e:
            raise RuntimeError(encode_error(e)) from e

    call.__name__ = getattr(func, "__name__", "method")
    return call


class RemoteModuleServer:
    """A GraphModule living in the server, with the methods the client calls.

    Every method takes and returns only what crosses RPC. Tensors passed in are copied
    (``set_input``/``load_params`` copy into the module's own storage, ``get_output(i, out)``
    copies into ``out``); nothing keeps a reference to a caller's tensor.
    """

    def __init__(self, module: GraphModule):
        self.module = module
        self.id = next(_IDS)
        _MODULES[self.id] = self
        self._returned: dict[tuple[str, int], Any] = {}  # views handed out, made once

    def _returnable(self, kind: str, index: int, tensor):
        # RPC loses byte_offset: hand out a pointer-moved view that owns its buffer.
        key = (kind, index)
        view = self._returned.get(key)
        if view is None:
            view = self._returned[key] = pointer_view(tensor, tensor.shape, str(tensor.dtype))
        return view

    def method(self, name: str):
        """The function of method ``name``. It holds this object and this object holds none of
        them: once the client has dropped every handle, the module is freed (a cycle through
        FFI objects would keep it forever; Python's collector cannot see into them)."""
        if name not in METHODS:
            raise HgrtError(f"remote module: method {did_you_mean(name, METHODS)}")
        return tvm_ffi.convert(_remote_call(getattr(self, name)))

    @property
    def live(self) -> GraphModule:
        if self.module is None:
            raise ClosedError(f"remote module {self.id} is closed")
        return self.module

    def close(self) -> None:
        """Free the module now (the client closed it); later calls are a ClosedError."""
        self.module = None
        self._returned.clear()
        _MODULES.pop(self.id, None)

    # ---- description (one round trip at create time) ------------------------------------
    def info(self) -> str:
        """What the client cannot know from its own copy of the graph."""
        m = self.live
        return json.dumps({"id": self.id, "device_bytes": m.device_bytes, "repr": repr(m),
                           "devices": [str(d) for d in m.devices]})

    # ---- running --------------------------------------------------------------------------
    def run(self) -> None:
        self.live.run()

    def run_mode(self, parallel: int) -> None:
        """``run(parallel=...)``: 1 streams at once, 0 one step at a time."""
        self.live.run(parallel=bool(parallel))

    def infer(self, indices_json: str, *data) -> bytes:
        """The call API (``m(x=...)``): the inputs at ``indices`` from ``data`` (bytes each),
        run in a frame of the call's own (what ``set_input`` set is untouched); the outputs'
        bytes, one after another."""
        m = self.live
        try:
            indices = json.loads(str(indices_json))
        except ValueError as e:
            raise InputError(f"call: the input indices are not JSON: {e}") from None
        if not isinstance(indices, list) or len(indices) != len(data):
            raise InputError(f"call: {len(data)} inputs sent for indices {str(indices)[:80]}")
        inputs = {i: self._input_array(i, d) for i, d in zip(indices, data, strict=True)}
        return wire.arrays_to_bytes(m.infer(inputs))

    def run_stage(self, seq: int, spec_json: str) -> bytes:
        """One input through this module as a pipeline stage: its tensors ``take``n from the
        session's inbox (``inputs`` maps their names to input indices), run in a frame of the
        call's own, the tensors ``send`` (the module's ``outputs`` by name, or ones taken) sent
        to the inbox of ``outbox``; the seconds from the tensors' arrival to the last send
        (float64), then the bytes of the tensors ``return``, one after another."""
        spec = wire.decode_stage_spec(spec_json)
        m = self.live
        stream = str(spec.get("stream", ""))
        # a stage started unannounced admits its module's inputs, one input at a time
        got = _inbox().take(int(seq), spec["take"], float(spec.get("timeout",
                                                                   channel.TAKE_TIMEOUT)),
                            stream, self._input_types(spec), window=1)
        t0 = time.perf_counter()
        outs = m.infer({int(i): got[n] for n, i in spec["inputs"].items()})
        values = {**got, **dict(zip(spec["outputs"], outs, strict=True))}
        unknown = [n for n in spec["send"] + spec["return"] if n not in values]
        if unknown:
            raise InputError(f"run_stage: {unknown} are neither taken nor outputs "
                             f"({sorted(values)})")
        if spec["send"]:
            box = _OUTBOXES.get(int(spec["outbox"]))
            if box is None:
                raise InputError(f"run_stage: no outbox {spec['outbox']} in this RPC session")
            for n in spec["send"]:
                box.send(int(seq), n, values[n], stream)
        return wire.encode_stage_reply(time.perf_counter() - t0,
                                       [values[n] for n in spec["return"]])

    def announce(self, spec_json: str) -> None:
        """What the stage of ``spec_json`` (an announcement, ``hgrt.rpc.wire``) will take from
        the session's inbox: only those tensors, of those types, within its window, are
        admitted. The types of the module's inputs are the module's own."""
        spec = wire.decode_stage_spec(spec_json)
        types, window, first = wire.decode_announcement(spec)
        own = self._input_types(spec)
        for name in spec["take"]:
            said = types.get(name)
            if name in own and said is not None and said != own[name]:
                raise InputError(f"announce: tensor {name!r} is {said[0]}{list(said[1])}, the "
                                 f"module's input is {own[name][0]}{list(own[name][1])}")
            if name not in own and said is None:
                raise InputError(f"announce: tensor {name!r} is taken but is no input of the "
                                 f"module and has no type")
        _inbox().announce(str(spec.get("stream", "")),
                          {n: own.get(n) or types[n] for n in spec["take"]}, window, first)

    def _input_types(self, spec: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``(dtype, shape)`` of the taken tensors that are the module's inputs."""
        g = self.live.graph
        out = {}
        for name, index in spec["inputs"].items():
            if isinstance(index, bool) or not isinstance(index, int) \
                    or not 0 <= index < len(g.arg_nodes):
                raise InputError(f"stage: tensor {name!r} goes to input {index!r}; the graph "
                                 f"has {len(g.arg_nodes)} inputs")
            eid = g.entry_id(g.arg_nodes[index])
            out[name] = (str(g.dtypes[eid]), tuple(int(d) for d in g.shapes[eid]))
        return out

    def invoke(self, name: str, args_json: str) -> str:
        """The rest of the module API that crosses as JSON: ``state`` (missing params, unset
        inputs), ``defer_params``, ``sync``, ``configure_streams``, ``configure_calls``."""
        m = self.live
        try:
            args = json.loads(str(args_json))
        except ValueError as e:
            raise InputError(f"{name}: the arguments are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise InputError(f"{name}: the arguments must be a JSON object")
        if name == "state":
            return json.dumps({"missing_params": m.missing_params,
                               "unset_inputs": m.unset_inputs})
        actions = {"defer_params": m.defer_params, "sync": m.sync,
                   "configure_streams": m.configure_streams,
                   "configure_calls": m.configure_calls}
        if name not in actions:
            raise InputError(f"remote module: {did_you_mean(name, ['state', *actions])}")
        try:
            actions[name](**args)
        except TypeError as e:
            raise InputError(f"{name}: {e}") from None
        return "null"

    def benchmark(self, repeat: int, number: int, warmup: int) -> str:
        return json.dumps(self.live.benchmark(*benchmark_args(repeat, number, warmup)).results)

    # ---- inputs ---------------------------------------------------------------------------
    def _input_array(self, index: int, data: bytes) -> np.ndarray:
        g = self.live.graph
        if isinstance(index, bool) or not isinstance(index, int) \
                or not 0 <= index < len(g.arg_nodes):
            raise InputError(f"input index {index!r} out of range: the graph has "
                             f"{len(g.arg_nodes)} inputs")
        if not isinstance(data, (bytes, bytearray)):
            raise InputError(f"input {index}: expected bytes, got {type(data).__name__}")
        eid = g.entry_id(g.arg_nodes[index])
        shape, dtype = tuple(g.shapes[eid]), g.dtypes[eid]
        want = g.entry_bytes(eid)
        if len(data) != want:
            raise InputError(f"input {g.nodes[g.arg_nodes[index]].name!r}: got {len(data)} "
                             f"bytes, expected {want} ({shape} {dtype})")
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def set_input_bytes(self, index: int, data: bytes) -> None:
        # np.frombuffer views the received bytes; set_input copies them into our storage.
        self.live.set_input(index, self._input_array(index, data))

    def set_input_tensor(self, index: int, tensor) -> None:
        self.live.set_input(int(index), tensor)  # copies: the tensor is the caller's view

    def _tensor(self, kind: str, index: int):
        return self._returnable(kind, int(index), getattr(self.live, f"get_{kind}")(int(index)))

    def _bytes(self, kind: str, index: int) -> bytes:
        return getattr(self.live, f"get_{kind}")(int(index)).numpy().tobytes()

    def _into(self, kind: str, index: int, out) -> None:
        getattr(self.live, f"get_{kind}")(int(index), out)

    # get_input/get_output: the remote tensor; *_bytes: its bytes; *_into: copied into `out`
    get_input, get_output = partialmethod(_tensor, "input"), partialmethod(_tensor, "output")
    get_input_bytes = partialmethod(_bytes, "input")
    get_output_bytes = partialmethod(_bytes, "output")
    get_input_into, get_output_into = partialmethod(_into, "input"), partialmethod(_into, "output")

    # ---- params ---------------------------------------------------------------------------
    def load_params(self, blob: bytes, strict: bool) -> None:
        self.live.load_params(bytes(blob), strict=bool(strict))

    def share_params(self, other_id: int, names_json: str) -> None:
        other = _MODULES.get(int(other_id))
        if other is None:
            raise ParamError(f"share_params: module {other_id} is not alive in this RPC "
                             "session")
        try:
            names = json.loads(str(names_json))
        except ValueError as e:
            raise ParamError(f"share_params: the names are not JSON: {e}") from None
        if names is not None and (not isinstance(names, list)
                                  or not all(isinstance(n, str) for n in names)):
            raise ParamError(f"share_params: expected a list of param names, got "
                             f"{str(names)[:80]}")
        params = None if names is None else dict.fromkeys(names)
        self.live.share_params(other.live, params)
        self._returned.clear()  # inputs now live in the other module's storage


def remote_create(graph_json: str, lib, *devices) -> Any:
    """``hgrt.remote.create``: build the executor here and return its method table.

    >>> f = session.get_function("hgrt.remote.create")           # doctest: +SKIP
    >>> method = f(graph_json, remote_lib, session.cpu(0), session.cpu(1))   # doctest: +SKIP
    >>> method("run")()                                          # doctest: +SKIP
    """
    if not isinstance(graph_json, str):
        try:
            graph_json = bytes(graph_json).decode()
        except (TypeError, UnicodeDecodeError) as e:
            raise GraphError(f"the graph JSON must be UTF-8 text: {e}") from None
    if not isinstance(lib, tvm_ffi.Module):  # never a path: the server loads no file by name
        raise InputError(f"create: lib must be a module uploaded to this RPC session "
                         f"(hgrt.rpc.upload), got {type(lib).__name__}")
    module = create(graph_json, lib, list(devices))  # devices arrive without the session mask
    server = RemoteModuleServer(module)
    # The returned function keeps `server` (and its module, storage and lib) alive for as long
    # as the client holds it.
    return tvm_ffi.convert(_remote_call(server.method))


# The inbox and links of this RPC session's process; only its RPC loop (one thread) uses them.
_OUTBOXES: dict[int, channel.Outbox] = {}
_OUTBOX_IDS = itertools.count(1)


@functools.cache
def _inbox() -> channel.Inbox:
    """This RPC session's inbox, made when first asked for."""
    return channel.Inbox(channel.SESSION_ADDRESS)


def remote_inbox() -> str:
    """``hgrt.remote.inbox``: where this RPC session takes tensors from peers (address, port, and
    the token a sender must give first), as JSON."""
    return _inbox().describe()


def remote_outbox(host: str, port: int, token_hex: str) -> int:
    """``hgrt.remote.outbox``: connect this RPC session to another one's inbox; its id."""
    try:
        token = bytes.fromhex(str(token_hex))
    except ValueError:
        raise InputError("outbox: the token is not hex") from None
    key = next(_OUTBOX_IDS)  # never reused: a late call cannot reach a newer link
    _OUTBOXES[key] = channel.Outbox(str(host), int(port), token)
    return key


def remote_outbox_close(key: int) -> int:
    """``hgrt.remote.outbox_close``: drop the link ``key`` (unknown ids are ignored)."""
    box = _OUTBOXES.pop(int(key), None)
    if box is not None:
        box.close()
    return 0


def remote_platform() -> str:
    """``hgrt.remote.platform``: what the server runs on, as JSON (checked before uploads)."""
    return json.dumps({"machine": platform.machine(), "system": platform.system(),
                       "tvm": tvm.__version__, "hgrt": _hgrt_version()})


def remote_stats() -> str:
    """``hgrt.remote.stats``: the modules alive in this RPC session's process, the bytes
    they allocated, and the process's resident memory (what a soak test watches)."""
    alive = [m.module for m in list(_MODULES.values()) if m.module is not None]
    return json.dumps({"modules": len(alive),
                       "module_bytes": sum(sum(m.device_bytes) for m in alive),
                       "rss_bytes": rss_bytes()})


def rss_bytes() -> int:
    """Resident memory of this process (Linux: /proc/self/statm; elsewhere 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def remote_ping() -> int:
    """``hgrt.remote.ping``: does nothing; one bare round trip (health checks, benchmarks)."""
    return 0


def _hgrt_version() -> str:
    try:
        return importlib.metadata.version("hgrt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
        tvm_ffi.register_global_func(STATS_FUNC, _remote_call(remote_stats), override=override)
        for name, func in ((INBOX_FUNC, remote_inbox), (OUTBOX_FUNC, remote_outbox),
                           (OUTBOX_CLOSE_FUNC, remote_outbox_close)):
            tvm_ffi.register_global_func(name, _remote_call(func), override=override)


def is_registered() -> bool:
    return tvm_ffi.get_global_func(CREATE_FUNC, allow_missing=True) is not None


def _server_init() -> None:
    # Runs first in each session process (shipped there by cloudpickle, by reference).
    import hgrt.rpc.server

    hgrt.rpc.server.register()


def _session_summary() -> str:
    # The end of a session's log line, from its own process: what the client left behind.
    gc.collect()
    stats = json.loads(remote_stats())
    return (f"{stats['modules']} hgrt module(s) still alive ({stats['module_bytes']} bytes), "
            f"process RSS {stats['rss_bytes'] / 2**20:.1f} MiB")


def serve(host: str = "127.0.0.1", port: int = 9090, port_end: int = 9199,
          tracker: str | tuple[str, int] | None = None, key: str = "", *,
          custom_addr: str | None = None, silent: bool = False,
          load_library: str | None = None, allow: Sequence[str] = (),
          max_session: float = 0.0, session_start: str = "auto") -> RPCServer:
    """Start a TVM RPC server that also serves hgrt; returns it (``.port``, ``.terminate()``,
    ``.join()``). Each session runs in its own process, which exits with the session and logs
    how many hgrt modules the client left alive there.

    With ``tracker`` ("host:port"), the server registers there under ``key``; without, it is
    standalone and ``key`` is what clients must give to ``tvm.rpc.connect``.

    ``host`` is where it listens: loopback by default; anyone who reaches the port runs the
    code they upload (TVM RPC has no authentication). ``allow`` (addresses or CIDR blocks)
    limits who that is: any other client's connection is closed before the handshake.

    Sessions are served one at a time. A session ends when its client closes it or is gone (a
    client killed during a long call frees the server within seconds), and after
    ``max_session`` seconds (0: only the client's own ``session_timeout`` bounds it): a client
    that never closes would hold the server for good.

    ``session_start``: "fork", "spawn", or "auto" (fork unless a CUDA driver is present: a
    process forked after TVM's import cannot use the GPU; see ``session_start_method``).

    >>> server = serve("10.0.0.7", 9090, tracker="10.0.0.1:9190", key="jetson",
    ...                allow=["10.0.0.0/24"])                                   # doctest: +SKIP
    >>> server.join()                                                           # doctest: +SKIP
    """
    tracker_addr = parse_address(tracker, "tracker") if isinstance(tracker, str) else tracker
    if tracker_addr is not None and not key:
        raise InputError("a server registered with a tracker needs a key (e.g. key='jetson')")
    return RPCServer(ListenConfig(
        host, port, port_end, key=key, tracker=tracker_addr, custom_addr=custom_addr,
        allow=parse_allow(allow), load_library=load_library, silent=silent,
        session_init=_server_init, session_summary=_session_summary,
        max_session=float(max_session), session_start=session_start))
