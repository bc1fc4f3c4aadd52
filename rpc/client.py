"""The client side: ``create_remote`` -> RemoteGraphModule, a GraphModule that runs in a server.

``hgrt.create(graph_json, lib, [remote.cpu(0), remote.cpu(1)])`` lands here. The graph JSON,
the remote library and the devices are sent once; the server builds the executor and returns
its methods. Each method is fetched once, so every API call afterwards (``run``, ``set_input``,
``get_output``, ...) is exactly one round trip; the graph's shapes and names are known here, so
``get_input_info`` and friends cost none.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import tvm

from hgrt import devices as hdev
from hgrt.artifacts import params_to_bytes
from hgrt.errors import ClosedError, DeviceError, GraphError, HgrtError, ParamError, RemoteError
from hgrt.graph import Graph
from hgrt.rpc import session as sessions
from hgrt.rpc import wire
from hgrt.rpc.inbox_call import CallTransfer
from hgrt.rpc.protocol import (
    CREATE_FUNC,
    INBOX_FUNC,
    OUTBOX_CLOSE_FUNC,
    OUTBOX_FUNC,
    PING_FUNC,
    decode_error,
)
from hgrt.rpc.server import is_registered, register
from hgrt.rpc.session import describe, server_host, upload
from hgrt.rpc.wire import InboxAddress, arrays_from_bytes
from hgrt.runtime.module_api import (
    BenchmarkResult,
    GraphModuleAPI,
    benchmark_args,
    decode_params,
)

__all__ = ["RemoteGraphModule", "create_remote"]

log = logging.getLogger(__name__)


def _session_of(devices: list, lib) -> tuple[tvm.rpc.RPCSession, int]:
    """The one RPC session all ``devices`` (and ``lib``, if remote) belong to."""
    local = [str(d) for d in devices if not hdev.is_remote(d)]
    if local:
        raise DeviceError(f"cannot mix local and remote devices: {local} are local, "
                          f"{[_dev_name(d) for d in devices if hdev.is_remote(d)]} are remote; "
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
    name = hdev.device_name(dev)
    return f"{name} (session {sessions.session_index(dev)})" if hdev.is_remote(dev) else name


def _graph(graph_json: Any) -> Graph:
    if isinstance(graph_json, Graph):
        return graph_json
    if isinstance(graph_json, (bytes, bytearray, str, Mapping)):
        return Graph.from_json(graph_json)
    raise GraphError(f"graph_json must be a JSON string, bytes, dict or Graph, got "
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


_LOCKS: dict[int, threading.Lock] = {}  # per RPC session: its modules' calls one at a time


class _Session:
    """Turns failures of remote calls into hgrt errors that name the session."""

    def __init__(self, sess: tvm.rpc.RPCSession, index: int):
        self.sess = sess
        self.index = index
        self.name = describe(sess)
        self.lost: str | None = None  # why the connection is gone, once it is
        self.lock = _LOCKS.setdefault(index, threading.Lock())

    def error(self, e: BaseException, what: str) -> HgrtError:
        err = decode_error(e, self.name)
        if err is not None:
            return err
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
        if self._answers():  # the call failed here (an argument RPC cannot carry, say)
            return RemoteError(f"{self.name}: {what} failed: {why}")
        self.lost = why  # the connection itself failed: every later call says so at once
        return RemoteError(f"{self.name}: {what} failed, the server is unreachable or died "
                           f"({self.lost})")

    def _answers(self) -> bool:
        """Whether the server still answers a bare round trip."""
        try:
            self.sess.get_function(PING_FUNC)()
            return True
        except Exception:
            return False

    def detached(self) -> _Session:
        """The RPC session's name and state, without the connection (a closed module's)."""
        out = object.__new__(_Session)
        out.sess, out.index, out.name, out.lost, out.lock = None, self.index, self.name, \
            self.lost, self.lock
        return out

    def check(self, what: str) -> None:
        if self.lost is not None:
            raise RemoteError(f"{self.name}: cannot {what}, the session was lost earlier "
                              f"({self.lost}); connect again")


class RemoteGraphModule(GraphModuleAPI):
    """A GraphModule that lives in an RPC server; the same API, one round trip per call.

    Everything the graph alone answers (input names, shapes, output count, argument checks) is
    answered here from the client's own copy of the graph, at no round trip.

    >>> remote = hgrt.rpc.connect(tracker="10.0.0.1:9190", key="jetson")  # doctest: +SKIP
    >>> m = hgrt.create(graph_json, hgrt.rpc.upload(remote, "out/lib.so"),
    ...                 [remote.cpu(0), remote.cuda(0)])                   # doctest: +SKIP
    >>> m.set_input("x", x); m.run(); y = m.get_output(0).numpy()          # doctest: +SKIP
    """

    def __init__(self, graph: Graph, lib, devices: list, session: _Session, method):
        super().__init__(graph, devices)
        self.lib = lib
        self.session = session
        self._method = method
        self._methods: dict[str, Any] = {}
        self._unfreed: RemoteError | None = None  # why the last close() could not free it
        info = json.loads(self._call("info"))
        self._id = info["id"]
        self._device_bytes = info["device_bytes"]
        self._server_repr = info["repr"]
        self._run = self._fetch("run")
        self._transfer = CallTransfer(isinstance(session.sess, tvm.rpc.LocalSession))

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
        self._check_open()
        if self.session.lost is not None:
            self.session.check(f"call {name}")
        f = self._methods.get(name) or self._fetch(name)
        try:
            return f(*args)
        except Exception as e:
            raise self.session.error(e, name) from e

    # ---- lifetime -------------------------------------------------------------------------
    def close(self) -> None:
        """Free the module in the server now; any later call is a ``ClosedError``.

        Where the server does not confirm it (its ``close`` failed, or the connection broke
        during it), a ``RemoteError`` naming the module and the server says so, and it is
        logged: the module is closed here all the same, and ``close()`` again retries while the
        server answers. Where the RPC session was lost before (the call that found it raised
        then), nothing reaches the server, which drops a session's modules when the session
        ends: ``close()`` logs that and returns."""
        with self._stateful:  # a run, set_input or get_output in flight finishes first
            if self.closed and self._unfreed is None:
                return
            self.closed = True
            self._release()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception leaves the block: a failed free (logged) does not replace it
            self.close()
        except HgrtError:
            pass

    def _release(self) -> None:
        """Free the module in the server now, then drop every handle of it here (but the one
        of ``close``, for a retry, where the server answers and did not confirm it)."""
        closed = ClosedError(f"{self!r} is closed; create or load it again")

        def refuse():
            raise closed

        self._run, self.lib = refuse, None
        close = self._methods.get("close")
        self._methods = {}
        if self.session.lost is not None:
            log.warning("%r was not freed by close(): the RPC session was lost (%s); its server "
                        "drops a session's modules when the session ends", self,
                        self.session.lost)
            self._method, self._unfreed = None, None
            self._let_go()
            return
        try:
            close = close or self._method("close")
            close()
        except Exception as e:
            err = str(self.session.error(e, "close"))  # marks the session lost if it is gone
            err = err.removeprefix(f"{self.session.name}: ")
            retry = self.session.lost is None
            self._unfreed = RemoteError(
                f"{self.session.name}: the server did not confirm freeing remote module "
                f"{self._id} ({self._server_repr}): {err}; " +
                ("it may still hold the module's memory: close() again retries" if retry else
                 "the RPC session is lost, and its server drops a session's modules when the "
                 "session ends"))
            log.warning("%s", self._unfreed)
            if retry:
                self._methods = {"close": close} if close is not None else {}
            else:
                self._method = None
                self._let_go()
            raise self._unfreed from e
        self._method, self._unfreed = None, None
        self._let_go()

    def _let_go(self) -> None:
        """Hold nothing of the RPC session any more (the caller's to drop: once it does, the
        server is free for the next client); names stay for messages."""
        self._transfer.close()
        self.session = self.session.detached()
        self.devices = [tvm.runtime.Device(*hdev.dlpack_device(d)) for d in self.devices]

    # ---- running --------------------------------------------------------------------------
    def run(self, parallel: bool | None = None, **inputs) -> None:
        """Run the graph once in the server: one round trip (plus one per input in
        ``inputs``); ``parallel`` as ``GraphModule.run``."""
        items = self._checked_inputs(inputs) if inputs else ()
        if self.session.lost is not None:
            self.session.check("run")
        if not self._stateful.acquire(blocking=False):
            raise self._in_use("run")
        try:
            for idx, value in items:
                self._store(idx, value)
            if parallel is not None:
                self._call("run_mode", int(bool(parallel)))
            else:
                self._run()
        except (ClosedError, HgrtError):
            raise
        except Exception as e:
            raise self.session.error(e, "run") from e
        finally:
            self._stateful.release()

    def benchmark(self, repeat: int = 5, number: int = 10, warmup: int = 1) -> BenchmarkResult:
        """Time ``run()`` in the server (no network in the figures): seconds per run."""
        self._check_open()
        repeat, number, warmup = benchmark_args(repeat, number, warmup)
        return BenchmarkResult(tuple(json.loads(self._call("benchmark", repeat, number,
                                                           warmup))))

    def _invoke(self, name: str, **args):
        return json.loads(self._call("invoke", name, json.dumps(args)))

    def sync(self) -> None:
        """Wait until the server's devices have finished their queued work."""
        self._invoke("sync")

    def configure_streams(self, threads: Mapping[str, int] | None = None,
                          parallel: bool | None = None) -> None:
        """As ``GraphModule.configure_streams``, in the server."""
        self._invoke("configure_streams", threads=None if threads is None else dict(threads),
                     parallel=parallel)

    def configure_calls(self, callers: int = 1, threads_per_call: int | None = None,
                        max_frames: int | None = None) -> None:
        """As ``GraphModule.configure_calls``, for the server's frames."""
        self._invoke("configure_calls", callers=callers, threads_per_call=threads_per_call,
                     max_frames=max_frames)

    def profile(self, repeat: int = 10, warmup: int = 1):
        raise RemoteError(f"{self.session.name}: profile times each step where it runs; "
                          f"benchmark() times whole runs remotely, or profile the same build "
                          f"with hgrt.create on the server's machine")

    # ---- values ---------------------------------------------------------------------------
    def __call__(self, inputs: Mapping | None = None, /, *, out: list | None = None, **kw):
        """Like ``GraphModule.__call__``: thread-safe, but the calls of one module go through
        its session one at a time (the server runs a session's calls in order)."""
        return self.infer({**(inputs or {}), **kw}, out=out)

    def infer(self, inputs: Mapping, out: list | None = None) -> list:
        """One call: the inputs go, the outputs come back; the server runs the call in a frame
        of its own, so what ``set_input`` set stays as it was. The inputs travel through the
        session's inbox where this client reaches it, else through TVM RPC (``transfer``)."""
        self._check_open()
        items = self._call_inputs(inputs)
        outs = self._call_outputs(out)
        arrays = [(i, np.ascontiguousarray(v.numpy() if isinstance(v, tvm.runtime.Tensor)
                                           else v)) for i, v in items]
        data = self._transfer.infer(self, arrays, lambda: self._rpc_infer(arrays), self._stage_call)
        g, results = self.graph, []
        arrays = arrays_from_bytes(data, [(g.shapes[e], g.dtypes[e]) for e in self._output_eids],
                                   f"{self.session.name}: infer")
        for i, arr in enumerate(arrays):
            if outs is None:
                results.append(arr.copy())
            elif isinstance(outs[i], np.ndarray):
                outs[i][...] = arr
            else:
                outs[i].copyfrom(arr)
        return results if outs is None else outs

    def _rpc_infer(self, arrays: list[tuple[int, np.ndarray]]) -> bytes:
        """A call's outputs' bytes, its inputs sent as bytes through TVM RPC."""
        blobs = [a.tobytes() for _, a in arrays]
        with self.session.lock:
            return self._call("infer", json.dumps([i for i, _ in arrays]), *blobs)

    def _stage_call(self, seq: int, spec_json: str) -> bytes:
        """A call's outputs' bytes, its inputs in the inbox (the caller holds the lock)."""
        data = self._call("run_stage", int(seq), spec_json)
        return wire.decode_stage_reply(data, f"{self.session.name}: infer")[1]

    @property
    def transfer(self) -> str:
        """How the next call moves its tensors: "inbox" (the session's inbox, a plain socket)
        or "rpc" (TVM RPC: the inbox is not reachable from here, or ``configure_transfer``)."""
        return self._transfer.path

    def configure_transfer(self, mode: str = "auto") -> None:
        """How calls move their inputs: "auto" (the session's inbox where this client reaches
        it, else TVM RPC, with one log line), "inbox" (a ``RemoteError`` where it is not
        reached) or "rpc".

        >>> m.configure_transfer("rpc"); m(x=x)                        # doctest: +SKIP
        """
        self._transfer.configure(mode)

    # ---- board to board (a pipeline's stages) --------------------------------------------
    def run_stage(self, seq: int, spec: Mapping) -> tuple[float, bytes]:
        """One input through this module as a pipeline stage, its tensors to and from the
        session's inbox (``spec``: ``hgrt.rpc.wire.stage_spec``): the seconds the server spent
        on it once its tensors were there, and the bytes of the tensors the spec returns."""
        with self.session.lock:
            data = self._call("run_stage", int(seq), wire.encode_stage_spec(spec))
        return wire.decode_stage_reply(data, f"{self.session.name}: run_stage")

    def announce(self, spec: Mapping) -> None:
        """Tell the session's inbox what the stage of ``spec`` will take (an announcement,
        ``hgrt.rpc.wire.announcement``): it admits only those tensors, of those types, within
        the announced window. Before the stream's first tensor is sent."""
        with self.session.lock:
            self._call("announce", wire.encode_stage_spec(spec))

    def inbox(self) -> InboxAddress:
        """Where this module's RPC session takes tensors from peers (``hgrt.rpc.channel``), as
        this client reaches it, and the token a sender gives first."""
        sess = self.session.sess
        text = self._session_call(INBOX_FUNC, "open its inbox")
        return wire.parse_inbox_address(text, server_host(sess))

    def link(self, to: InboxAddress) -> int:
        """Connect this module's RPC session to the inbox ``to`` (another board's): the link's
        id, a stage spec's ``outbox``. A ``RemoteError`` when this board cannot reach it."""
        return int(self._session_call(OUTBOX_FUNC, f"link to the inbox at {to}", to.host,
                                      int(to.port), to.token.hex()))

    def unlink(self, link: int) -> None:
        """Drop the link ``link`` (an unknown id, or a board already gone: nothing to drop)."""
        try:
            self._session_call(OUTBOX_CLOSE_FUNC, "drop a link", int(link))
        except HgrtError:
            pass

    def _session_call(self, func: str, what: str, *args):
        """Call the RPC session's global function ``func`` (board-to-board transfer)."""
        self._check_open()
        self.session.check(what)
        try:
            f = self.session.sess.get_function(func)
        except Exception as e:  # noqa: BLE001 - an older server: say what to do
            raise RemoteError(f"{self.session.name}: the server has no {func!r} for "
                              f"board-to-board transfer (an older hgrt rpc-server?); update "
                              f"it, or use transfer='client'") from e
        try:
            return f(*args)
        except Exception as e:
            raise self.session.error(e, what) from e

    def _store(self, idx: int, value: Any) -> None:
        """numpy data is sent as bytes (one round trip); a tensor of this RPC session is copied
        in the server (nothing downloaded); a local tensor is sent as bytes."""
        if isinstance(value, tvm.runtime.Tensor) and hdev.is_remote(value):
            name = self.graph.nodes[self.graph.arg_nodes[idx]].name
            self._check_same_session(value, f"input {name!r}")
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

    def _get(self, kind: str, idx: int, out):
        """The remote tensor (valid until the next run), or a copy in ``out`` (a tensor of this
        RPC session, copied in the server, or a local one, downloaded as bytes)."""
        with self._claim(f"get_{kind}"):
            if out is None:
                return self._call(f"get_{kind}", idx)
            if hdev.is_remote(out):
                self._check_same_session(out, f"{kind} {idx}: out")
                self._call(f"get_{kind}_into", idx, out)
            else:
                data = self._call(f"get_{kind}_bytes", idx)
                out.copyfrom(np.frombuffer(data, dtype=str(out.dtype)).reshape(tuple(out.shape)))
            return out

    # ---- params ---------------------------------------------------------------------------
    def load_params(self, params: bytes | bytearray | Mapping, strict: bool = True) -> None:
        """Params as ``save_param_dict`` bytes or a dict of arrays; sent in one round trip."""
        if isinstance(params, Mapping):
            params = {k: v.numpy() if hdev.is_remote(v) else v for k, v in params.items()}
        elif not isinstance(params, (bytes, bytearray)):
            raise ParamError(f"params must be bytes or a dict of arrays, got "
                             f"{type(params).__name__}")
        self._call("load_params", params_to_bytes(params), bool(strict))

    def defer_params(self) -> None:
        """As ``GraphModule.defer_params``, in the server."""
        self._invoke("defer_params")

    @property
    def missing_params(self) -> list[str]:
        return self._invoke("state")["missing_params"]

    @property
    def unset_inputs(self) -> list[str]:
        return self._invoke("state")["unset_inputs"]

    def share_params(self, other: RemoteGraphModule, params: bytes | Mapping | None = None) -> None:
        """Read ``other``'s parameter tensors (no copy); both modules must be in one session."""
        if not isinstance(other, RemoteGraphModule):
            raise ParamError(f"share_params: a remote module can only share with another remote "
                             f"module of {self.session.name}, got {type(other).__name__}")
        if other.session.index != self.session.index:
            raise ParamError(f"share_params: the other module is in {other.session.name}, this "
                             f"one in {self.session.name}")
        names = None if params is None else list(decode_params(params))
        self._call("share_params", other._id, json.dumps(names))

    # ---- introspection --------------------------------------------------------------------
    @property
    def device_bytes(self) -> list[int]:
        return list(self._device_bytes)

    def __repr__(self) -> str:
        return f"Remote{self._server_repr} in {self.session.name}"


def create_remote(graph_json: Any, lib, devices) -> RemoteGraphModule:
    """Create the executor inside the RPC server that ``devices`` belong to.

    ``lib`` is a module of that session (``hgrt.rpc.upload``), a path to a ``.so`` (uploaded,
    never loaded here) or a local module (exported, then uploaded). ``hgrt.create`` calls this
    when its devices are remote.

    >>> m = create_remote(graph_json, lib, [remote.cpu(0), remote.cpu(1)])  # doctest: +SKIP
    """
    return create_remote_on(graph_json, lib, hdev.normalize_devices(devices))


def create_remote_on(graph_json: Any, lib, devs: list) -> RemoteGraphModule:
    """``create_remote`` on the list of tvm Devices that ``hgrt.devices.normalize_devices`` made
    of its ``devices`` (``hgrt.create`` makes it once)."""
    graph = _graph(graph_json)
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
    try:
        method = remote_create(graph.to_json(), rlib, *devs)
    except Exception as e:
        raise session.error(e, "create") from e
    return RemoteGraphModule(graph, rlib, devs, session, method)

