"""RPC sessions: finding a server (through a tracker or directly), naming a session in errors,
uploading a library after checking that the server can load it.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import struct
import time
import weakref
from dataclasses import dataclass

import tvm
from tvm.rpc import base as rpc_base

from hgrt.artifacts import check_library_file, library_machine
from hgrt.devices import machine_arch, rpc_session_index
from hgrt.errors import InputError, RemoteError
from hgrt.rpc.protocol import PLATFORM_FUNC, STATS_FUNC, parse_address


@dataclass
class _SessionRecord:
    session: weakref.ref
    description: str
    host: str | None = None  # the server's address as this client reached it


# Sessions opened through hgrt.rpc.connect, by TVM's session table index, for error messages
# and for finding the session of a remote device made without `session.cpu(0)`.
_SESSIONS: dict[int, _SessionRecord] = {}
_UPLOADS = itertools.count()


def session_index(obj) -> int:
    """TVM's session table index of a remote device, RPC module or RPCSession."""
    if isinstance(obj, tvm.runtime.Device):
        return rpc_session_index(obj)
    if isinstance(obj, tvm.rpc.RPCSession):
        return obj._tbl_index
    return tvm.rpc._ffi_api.SessTableIndex(obj)


def remember(session: tvm.rpc.RPCSession, description: str,
             host: str | None = None) -> tvm.rpc.RPCSession:
    _SESSIONS[session._tbl_index] = _SessionRecord(weakref.ref(session), description, host)
    return session


def server_host(session: tvm.rpc.RPCSession) -> str | None:
    """The address this client reached ``session``'s server at (None: not opened by
    ``connect``)."""
    rec = _SESSIONS.get(session_index(session))
    return rec.host if rec is not None and rec.session() is session else None


def find_session(index: int) -> tvm.rpc.RPCSession | None:
    rec = _SESSIONS.get(index)
    return rec.session() if rec is not None else None


def describe(session_or_index) -> str:
    """An RPC session's name in messages: "rpc session", its index in this process, then the
    tracker's address, the key and the server's address it was given."""
    index = session_or_index if isinstance(session_or_index, int) else \
        session_index(session_or_index)
    rec = _SESSIONS.get(index)
    if isinstance(session_or_index, tvm.rpc.LocalSession):
        return f"rpc session {index} (LocalSession)"
    if rec is not None and (not isinstance(session_or_index, tvm.rpc.RPCSession)
                            or rec.session() is session_or_index):
        return f"rpc session {index} ({rec.description})"
    return f"rpc session {index}"


def connect(tracker: str | None = None, key: str = "", *, server: str | None = None,
            timeout: float = 60.0, session_timeout: float = 0,
            priority: int = 1) -> tvm.rpc.RPCSession:
    """Open a TVM RPC session, through a tracker (by key) or straight to a server.

    ``timeout`` bounds the wait for a free server: after it, a ``RemoteError`` says what the
    tracker holds. ``session_timeout`` (seconds, 0 = none) lets the server end the session.

    >>> remote = hgrt.rpc.connect(tracker="10.0.0.1:9190", key="jetson")  # doctest: +SKIP
    >>> remote = hgrt.rpc.connect(server="10.0.0.2:9090")                 # doctest: +SKIP
    """
    if (tracker is None) == (server is None):
        raise InputError("connect: give exactly one of tracker='HOST:PORT' (with key=...) "
                         "or server='HOST:PORT'")
    if server is not None:
        host, port = parse_address(server, "server")
        where = f"server {host}:{port}"
        return remember(_open(host, port, key, session_timeout,
                              f"cannot open an RPC session with {where}"
                              f"{f' (key {key!r})' if key else ''}"), where, host)
    if not key:
        raise InputError("connect: a tracker request needs key=... (the server's --key)")
    addr = parse_address(tracker, "tracker")
    host, port, matchkey = _request_server(addr, key, timeout, priority)
    sess = _open(host, port, matchkey, session_timeout,
                 f"tracker {tracker} gave server {host}:{port} for key {key!r}, but the "
                 f"session could not be opened")
    return remember(sess, f"tracker {tracker}, key {key!r}, server {host}:{port}", host)


def _open(host: str, port: int, key: str, session_timeout: float, failure: str):
    try:
        return tvm.rpc.connect(host, port, key, session_timeout)
    except Exception as e:
        raise RemoteError(f"{failure}: {e}") from e


def _tracker_socket(addr: tuple[str, int], timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(addr, timeout=max(0.1, deadline - time.monotonic()))
            break
        except ConnectionRefusedError as e:
            if time.monotonic() >= deadline:
                raise RemoteError(f"no RPC tracker answers at {addr[0]}:{addr[1]} "
                                  f"(connection refused for {timeout:g} s)") from e
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        except OSError as e:
            raise RemoteError(f"cannot reach the RPC tracker at {addr[0]}:{addr[1]}: {e}") from e
    try:
        sock.sendall(struct.pack("<i", rpc_base.RPC_TRACKER_MAGIC))
        magic = struct.unpack("<i", rpc_base.recvall(sock, 4))[0]
    except OSError as e:
        sock.close()
        raise RemoteError(f"{addr[0]}:{addr[1]} did not answer as an RPC tracker: {e}") from e
    if magic != rpc_base.RPC_TRACKER_MAGIC:
        sock.close()
        raise RemoteError(f"{addr[0]}:{addr[1]} is not an RPC tracker")
    return sock


def tracker_summary(tracker: str | tuple[str, int], timeout: float = 5.0) -> dict:
    """The tracker's summary: ``{"server_info": [...], "queue_info": {key: {free, pending}}}``."""
    addr = parse_address(tracker, "tracker") if isinstance(tracker, str) else tracker
    sock = _tracker_socket(addr, timeout)
    try:
        sock.settimeout(timeout)
        rpc_base.sendjson(sock, [rpc_base.TrackerCode.SUMMARY])
        code, summary = rpc_base.recvjson(sock)
        return summary
    finally:
        sock.close()


def _request_server(addr: tuple[str, int], key: str, timeout: float,
                    priority: int) -> tuple[str, int, str]:
    """Ask the tracker for a server of ``key``; wait at most ``timeout`` seconds."""
    t0 = time.monotonic()
    sock = _tracker_socket(addr, timeout)
    try:
        sock.settimeout(max(0.01, timeout - (time.monotonic() - t0)))
        rpc_base.sendjson(sock, [rpc_base.TrackerCode.REQUEST, key, "", priority])
        value = rpc_base.recvjson(sock)
    except TimeoutError:
        raise RemoteError(f"no free RPC server for key {key!r} on tracker {addr[0]}:{addr[1]} "
                          f"after {timeout:g} s; {_what_tracker_has(addr, key)}") from None
    except OSError as e:
        raise RemoteError(f"tracker {addr[0]}:{addr[1]} dropped the request for key {key!r}: "
                          f"{e}") from e
    finally:
        sock.close()  # a pending request dies with its connection (the tracker skips it)
    if not isinstance(value, list) or value[0] != rpc_base.TrackerCode.SUCCESS:
        raise RemoteError(f"tracker {addr[0]}:{addr[1]} refused the request for key {key!r}: "
                          f"{value!r}")
    host, port, matchkey = value[1]
    return host, int(port), matchkey


def _what_tracker_has(addr: tuple[str, int], key: str) -> str:
    try:
        summary = tracker_summary(addr, timeout=2.0)
    except Exception as e:
        return f"(the tracker's summary could not be read: {e})"
    servers = sorted({s["key"].split(":", 1)[-1] for s in summary.get("server_info", [])
                      if str(s.get("key", "")).startswith("server:")})
    queue = summary.get("queue_info", {}).get(key)
    busy = f" (queue for {key!r}: {queue['free']} free, {queue['pending']} pending)" \
        if queue else ""
    return (f"the tracker knows servers for keys {servers}{busy}; start one with "
            f"`hgrt rpc-server --tracker {addr[0]}:{addr[1]} --key {key}`")


def server_platform(remote: tvm.rpc.RPCSession) -> dict | None:
    """What an hgrt server runs on (``machine``, ``system``, ``tvm``), None for a plain TVM one."""
    try:
        f = remote.get_function(PLATFORM_FUNC)
    except AttributeError:
        return None
    return json.loads(f())


def stats(remote: tvm.rpc.RPCSession) -> dict:
    """What the session's server process holds: ``{"modules": live hgrt modules,
    "module_bytes": their device memory, "rss_bytes": the process's resident memory}``.

    >>> hgrt.rpc.stats(remote)["modules"]    # doctest: +SKIP
    0
    """
    try:
        return json.loads(remote.get_function(STATS_FUNC)())
    except AttributeError:
        raise RemoteError(f"the server of {describe(remote)} does not serve hgrt: start it with "
                          f"`hgrt rpc-server`") from None
    except Exception as e:
        raise RemoteError(f"{describe(remote)}: stats failed: {e}") from e


def _target_hint(info: dict) -> str:
    """How to build for the server's machine: a JSON target (what TVM 0.27 itself takes; hgrt
    also translates option strings such as 'llvm -mtriple=...'), or one of TVM's target tags."""
    machine, system = info["machine"], str(info.get("system", "Linux")).lower()
    arch = machine_arch(machine)
    triple = f"{machine}-linux-{'gnueabihf' if arch == 'arm' else 'gnu'}" \
        if system == "linux" else f"{machine}-{system}"
    target = json.dumps({"kind": "llvm", "mtriple": triple})
    tag = " such as 'raspberry-pi/4b-aarch64'" if arch == "aarch64" else ""
    return (f"build it for the server's CPU with hgrt.build(..., target={{'cpu': '{target}'}}) "
            f"or `hgrt compile --target 'cpu={target}'` (or a TVM target tag{tag}; "
            f"tvm.target.list_tags() lists them)")


def upload(remote: tvm.rpc.RPCSession, path: str, name: str | None = None, *,
           check_arch: bool = True):
    """Upload a compiled library (.so, or .tar of objects that the server links) and load it
    on the server; returns the remote Module.

    With ``check_arch``, a library built for another architecture than the server's is
    refused before upload; without, the server's own loading error is reported.
    Each upload gets a new name on the server (``lib.so`` -> ``lib_<pid>_<n>.so``) unless
    ``name`` is given (a plain file name: the file lands in the session's work directory):
    rewriting a file the server has already loaded would corrupt that module. Once loaded, the
    file is removed there (the module stays loaded): a long session leaves no copies behind.

    >>> lib = hgrt.rpc.upload(remote, "out/lib.so")    # doctest: +SKIP
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"upload: no library at {path!r}")
    if name is None:
        stem, ext = os.path.splitext(os.path.basename(path))
        name = f"{stem}_{os.getpid()}_{next(_UPLOADS)}{ext}"
    if not name or name in (".", "..") or os.path.basename(name) != name or "\\" in name:
        raise InputError(f"upload: name must be a plain file name (it lands in the session's "
                         f"work directory), got {name!r}")
    check_library_file(path)  # a truncated file would kill the server's process (SIGBUS)
    where = describe(remote)
    lib_arch = library_machine(path)
    try:
        info = server_platform(remote) if lib_arch is not None and check_arch else None
    except Exception as e:
        raise RemoteError(f"{where}: cannot ask the server what it runs on: {e}") from e
    if info is not None:
        if lib_arch != machine_arch(info["machine"]):
            raise RemoteError(f"{path} is a library for {lib_arch}, but the server of {where} "
                              f"runs {info['machine']} ({info['system']}): {_target_hint(info)}"
                              f" and upload again")
    try:
        remote.upload(path, name)
    except Exception as e:
        raise RemoteError(f"{where}: uploading {path} failed: {e}") from e
    try:
        module = remote.load_module(name)
    except Exception as e:
        raise RemoteError(f"the server of {where} cannot load {path} (built for "
                          f"{lib_arch or 'an unknown platform'}): {e}") from e
    try:
        remote.remove(name)
    except Exception:  # a plain TVM server may lack it: the file stays in its work directory
        pass
    return module
