"""hgrt's RPC listen loop: TVM's server wire protocol with a gate in front of the handshake.

``tvm.rpc.Server`` accepts every connection inside a private loop, so a server that refuses
clients by address needs its own loop. This one speaks the same protocol (``tvm.rpc.base``:
magic, ``client:``/``server:`` keys, the tracker's PUT / UPDATE_INFO / GET_PENDING_MATCHKEYS)
and hands each accepted socket to TVM's own session loop (``tvm.rpc.server._serve_loop``, i.e.
``ServerLoop`` on the socket's fd) in a child process that exits with the session, as TVM does.
Only the accept, the address check, the key exchange and the tracker registration are hgrt's.

A client whose address is not allowed has its socket closed before a byte is read or sent.
Sessions are served one at a time, as in TVM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import ipaddress
import itertools
import logging
import math
import multiprocessing
import numbers
import os
import select
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
from tvm.rpc import _ffi_api
from tvm.rpc import base as rpc_base
from tvm.rpc.server import _parse_server_opt, _serve_loop
from tvm.support import utils
from tvm.support.popen_pool import PopenWorker

from hgrt.errors import InputError
from hgrt.rpc import channel, wire

logger = logging.getLogger("hgrt.rpc.server")
_handler = logging.StreamHandler()
_handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(message)s",
                                        datefmt="%Y-%m-%d %H:%M:%S"))
logger.addHandler(_handler)
logger.propagate = False

HANDSHAKE_TIMEOUT = 5.0  # seconds a client has, in all, for the key exchange (the loop waits)
MAX_KEY_BYTES = 4096
PING_PERIOD = 2.0  # seconds between tracker checks while no client comes (TVM's value)
UNMATCHED_TIMEOUT = 4.0  # a match key handed out but not used this long is replaced (TVM's)
SESSION_POLL = 0.5  # seconds between checks that a session's client is still there
_SESSIONS = itertools.count()  # names the sessions' work directories
GONE_GRACE = 2.0  # a session whose client hung up ends itself within this, else it is killed

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
SESSION_STARTS = ("auto", "fork", "spawn")


def parse_allow(specs: Sequence[str]) -> tuple[Network, ...]:
    """``--allow`` values (an address or a CIDR block each) as networks; () allows everyone.

    >>> parse_allow(["127.0.0.2", "10.0.0.0/24"])
    (IPv4Network('127.0.0.2/32'), IPv4Network('10.0.0.0/24'))
    """
    nets = []
    for spec in specs:
        try:
            nets.append(ipaddress.ip_network(str(spec).strip(), strict=False))
        except ValueError:
            raise InputError(f"--allow takes an IP address or a CIDR block (10.0.0.7, "
                             f"10.0.0.0/24, ::1), got {spec!r}") from None
    return tuple(nets)


def is_allowed(host: str, allow: Sequence[Network]) -> bool:
    """Whether a peer address is in ``allow`` (an IPv4 peer of a dual-stack socket counts as
    its IPv4 address)."""
    if not allow:
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in allow)


@dataclass(frozen=True)
class ListenConfig:
    """What a listen loop needs; crosses into the server process by pickle."""

    host: str
    port: int
    port_end: int
    key: str = ""
    tracker: tuple[str, int] | None = None
    custom_addr: str | None = None
    allow: tuple[Network, ...] = ()
    load_library: str | None = None
    silent: bool = False
    session_init: Callable[[], None] | None = None  # run in each session process first
    session_summary: Callable[[], str] | None = None  # its return ends the session's log line
    max_session: float = 0.0  # seconds a session may last whatever its client asks (0: no cap)
    work_root: str | None = None  # the sessions' work directories go here (the server's own)
    session_start: str = "auto"  # how a session process starts: "fork", "spawn" or "auto"

    def __post_init__(self) -> None:
        for name in ("port", "port_end"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise InputError(f"{name} must be an integer, got {value!r}")
        if not (isinstance(self.max_session, (int, float)) and 0 <= self.max_session < math.inf):
            raise InputError(f"max_session must be seconds >= 0 (0: no cap), got "
                             f"{self.max_session!r}")
        if self.session_start not in SESSION_STARTS:
            raise InputError(f"session_start {self.session_start!r}: one of {SESSION_STARTS}")
        if not 1 <= self.port <= 65535:
            raise InputError(f"port {self.port} is not a TCP port (1-65535)")
        if not self.port < self.port_end <= 65536:
            raise InputError(f"the ports to try, [{self.port}, {self.port_end}), hold none: the "
                             f"last port tried (`hgrt rpc-server --port-end`; serve()'s "
                             f"port_end is one past it) must be at least the first "
                             f"({self.port}) and at most 65535")


def _peer(addr) -> str:
    return f"{addr[0]}:{addr[1]}"


def _set_log_level(silent: bool) -> None:
    # --silent: no per-session lines; refusals and failures (warnings) still show
    logger.setLevel(logging.WARNING if silent else logging.INFO)
    logging.getLogger("RPCServer").setLevel(logging.ERROR if silent else logging.INFO)


# ---- the tracker ------------------------------------------------------------------------------
class TrackerLink:
    """The server's connection to its tracker: registers it, hands out match keys."""

    def __init__(self, cfg: ListenConfig, port: int):
        self.key, self.port, self.custom_addr = cfg.key, port, cfg.custom_addr
        self.used: set[str] = set()
        self.sock = rpc_base.connect_with_retry(cfg.tracker)
        self.sock.sendall(struct.pack("<i", rpc_base.RPC_TRACKER_MAGIC))
        if struct.unpack("<i", rpc_base.recvall(self.sock, 4))[0] != rpc_base.RPC_TRACKER_MAGIC:
            self.sock.close()
            raise InputError(f"{cfg.tracker[0]}:{cfg.tracker[1]} is not an RPC tracker")
        self._call([rpc_base.TrackerCode.UPDATE_INFO,
                    {"key": "server:" + self.key, "addr": [self.custom_addr, port]}])

    def _call(self, message: list):
        rpc_base.sendjson(self.sock, message)
        reply = rpc_base.recvjson(self.sock)
        if message[0] != rpc_base.TrackerCode.GET_PENDING_MATCHKEYS and \
                reply != rpc_base.TrackerCode.SUCCESS:
            raise OSError(f"the tracker answered {reply!r} to {message[0]}")
        return reply

    def put(self) -> str:
        """Offer this server to the tracker's clients under a new match key; returns it."""
        matchkey = rpc_base.random_key(self.key, cmap=self.used)
        self.used.add(matchkey)
        self._call([rpc_base.TrackerCode.PUT, self.key, (self.port, matchkey), self.custom_addr])
        return matchkey

    def pending(self) -> list[str]:
        """The match keys the tracker has not handed to a client yet."""
        return self._call([rpc_base.TrackerCode.GET_PENDING_MATCHKEYS])

    def close(self) -> None:
        self.sock.close()


# ---- accepting a client -----------------------------------------------------------------------
def _handshake(conn: socket.socket, addr, matchkey: str, key: str) -> dict | None:
    """TVM's key exchange; the session's options (``-timeout=``), or None when it failed."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT  # for the whole exchange, not per read
    try:
        if struct.unpack("<i", wire.recv_by(conn, 4, deadline))[0] != rpc_base.RPC_MAGIC:
            raise OSError("not a TVM RPC client (bad magic)")
        size = struct.unpack("<i", wire.recv_by(conn, 4, deadline))[0]
        if not 0 <= size <= MAX_KEY_BYTES:
            raise OSError(f"a key of {size} bytes")
        words = wire.recv_by(conn, size, deadline).decode("utf-8", "replace").split()
        if not words or words[0] != "client:" + matchkey:
            conn.sendall(struct.pack("<i", rpc_base.RPC_CODE_MISMATCH))
            raise OSError("mismatched key")
        try:
            opts = _parse_server_opt(words[1:])
        except ValueError:
            raise OSError(f"bad session options {' '.join(words[1:])!r}") from None
        server_key = ("server:" + key).encode()
        conn.sendall(struct.pack("<ii", rpc_base.RPC_CODE_SUCCESS, len(server_key)) + server_key)
    except OSError as e:
        logger.warning("closed the connection from %s: %s", _peer(addr), e)
        conn.close()
        return None
    conn.settimeout(None)  # back to a blocking socket: TVM's session loop reads its fd
    return opts




def session_limit(client_timeout, max_session: float) -> float | None:
    """Seconds a session may last: the shorter of the client's ``-timeout=`` and the server's
    cap, each counted only when it is a positive, finite number of seconds (a client's nan,
    inf or negative asks for nothing); None: no limit."""
    limits = [t for t in (client_timeout, max_session)
              if isinstance(t, numbers.Real) and math.isfinite(t) and t > 0]
    return min(limits) if limits else None


def _accept(sock: socket.socket, cfg: ListenConfig, matchkey: str) -> tuple | None:
    """One connection: (conn, addr, options) when it is allowed and shakes hands, else None."""
    conn, addr = sock.accept()
    if not is_allowed(addr[0], cfg.allow):
        conn.close()  # before any byte either way
        logger.warning("refused a connection from %s: not in --allow %s", _peer(addr),
                       " ".join(str(n) for n in cfg.allow))
        return None
    opts = _handshake(conn, addr, matchkey, cfg.key)
    return None if opts is None else (conn, addr, opts)


def _next_client(sock: socket.socket, link: TrackerLink | None, cfg: ListenConfig) -> tuple:
    """Wait for the next client that is allowed and knows the key (TVM's _accept_conn)."""
    matchkey = link.put() if link else cfg.key
    unmatched = 0
    while True:
        if link and not select.select([sock], [], [], PING_PERIOD)[0]:
            # a key the tracker handed out but nobody used: offer a fresh one
            unmatched = unmatched + 1 if matchkey not in link.pending() else 0
            if unmatched * PING_PERIOD > UNMATCHED_TIMEOUT + PING_PERIOD:
                logger.info("no client came with the match key the tracker handed out: "
                            "registering a new one")
                matchkey, unmatched = link.put(), 0
            continue
        client = _accept(sock, cfg, matchkey)
        if client is not None:
            return client


# ---- a session --------------------------------------------------------------------------------
def _session_main(conn: socket.socket, peer: str, cfg: ListenConfig, work) -> None:
    # The session process: hgrt's functions, then TVM's session loop until the client leaves.
    _set_log_level(cfg.silent)
    os.chdir(work.path)  # uploads of two sessions never meet
    channel.SESSION_ADDRESS = conn.getsockname()[0]  # a peer reaches its inbox where we were
    channel.SESSION_ALLOWED = functools.partial(is_allowed, allow=cfg.allow)  # its --allow
    if cfg.session_init is not None:
        cfg.session_init()
    _serve_loop(conn, cfg.load_library, work)
    summary = f": {cfg.session_summary()}" if cfg.session_summary is not None else ""
    logger.info("session from %s ended%s", peer, summary)


def session_start_method(choice: str = "auto") -> str:
    """How session processes start. A fork is fastest (the child has TVM and hgrt imported), but
    importing TVM on a machine with a CUDA driver initialises CUDA in the importing process, and a
    child forked from it cannot use the GPU (``cudaErrorInitializationError``). So "auto" forks
    only where no CUDA driver loads; elsewhere each session is a fresh interpreter (spawn), which
    costs its start the imports (about a second)."""
    if choice != "auto":
        return choice
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "fork"
    return "spawn"


def _client_gone(conn: socket.socket) -> bool:
    """Whether the client closed its end (killed, or its process ended): the session process
    may be busy in a long call and would not read the socket until it returns."""
    poller = select.poll()
    poller.register(conn.fileno(), getattr(select, "POLLRDHUP", 0) | select.POLLHUP
                    | select.POLLERR)
    return bool(poller.poll(0))


def _wait_session(proc, conn: socket.socket, limit: float | None) -> str | None:
    """Wait for the session process; why it must be killed (its time is up, its client is
    gone), or None when it ended by itself."""
    deadline = None if not limit else time.monotonic() + limit
    gone_at = None
    while True:
        proc.join(SESSION_POLL)
        if not proc.is_alive():
            return None
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return f"its {limit:g}s are up"
        if _client_gone(conn):
            gone_at = gone_at or now
            if now - gone_at >= GONE_GRACE:
                return "its client is gone"


def _serve_session(conn: socket.socket, addr, opts: dict, cfg: ListenConfig) -> None:
    """Run one session in a child process and wait for it: it ends when the client closes,
    when its ``-timeout=`` (or the server's ``max_session``) is up, or when its client is gone
    though the process is still busy (a call in flight when the client was killed)."""
    peer = _peer(addr)
    work = utils.tempdir(os.path.join(cfg.work_root, f"session-{next(_SESSIONS)}")
                         if cfg.work_root else None)
    logger.info("session from %s in %s", peer, work.path)
    context = multiprocessing.get_context(session_start_method(cfg.session_start))
    proc = context.Process(target=_session_main, args=(conn, peer, cfg, work))
    proc.start()
    limit = session_limit(opts.get("timeout"), cfg.max_session)
    why = _wait_session(proc, conn, limit)
    if why is not None:
        logger.info("session from %s: %s, killing it", peer, why)
        if why != "its client is gone":
            _ffi_api.ReturnException(conn.fileno(), f"RPCSessionTimeoutError: Your "
                                     f"{limit:g}s session has expired, try to increase "
                                     f"the \"session_timeout\" value.")
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except psutil.Error:
            pass
        proc.kill()
        proc.join()
    elif proc.exitcode != 0:
        logger.warning("session from %s: its process exited with %s", peer, proc.exitcode)
    work.remove()
    conn.close()


# ---- the loop ---------------------------------------------------------------------------------
def _listen_loop(sock: socket.socket, port: int, cfg: ListenConfig) -> None:
    link = None
    while True:
        try:
            if cfg.tracker and link is None:
                link = TrackerLink(cfg, port)
            client = _next_client(sock, link, cfg)
        except (OSError, RuntimeError) as e:  # the tracker went away or is not up yet; retry
            logger.warning("%s; trying again", f"tracker {cfg.tracker[0]}:{cfg.tracker[1]}: {e}"
                           if cfg.tracker else e)
            if link is not None:
                link.close()
                link = None
            time.sleep(1.0)
            continue
        try:
            _serve_session(*client, cfg)
        except Exception as e:  # one session's failure (no temp dir, no process) ends only it
            logger.warning("session from %s failed: %s", _peer(client[1]), e)
            client[0].close()


def _run_loop(sock: socket.socket, port: int, cfg: ListenConfig) -> None:
    try:
        _listen_loop(sock, port, cfg)
    except BaseException as e:  # the server cannot go on: say why, and end its process
        logger.error("hgrt rpc-server stopped: %s", e)
        os._exit(1)


def _bind(cfg: ListenConfig) -> tuple[socket.socket, int]:
    sock = socket.socket(rpc_base.get_addr_family((cfg.host, cfg.port)), socket.SOCK_STREAM)
    if sys.platform != "win32":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for port in range(cfg.port, cfg.port_end):
        try:
            sock.bind((cfg.host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                continue
            sock.close()
            raise InputError(f"cannot listen on {cfg.host}:{port}: {e}") from e
        sock.listen(4)
        return sock, port
    sock.close()
    raise InputError(f"cannot listen on {cfg.host}: every port in [{cfg.port}, {cfg.port_end}) "
                     f"is in use (--port/--port-end)")


def _start(cfg: ListenConfig) -> dict:
    # In the server process: bind, then serve from a thread while the worker waits for kill.
    _set_log_level(cfg.silent)
    try:
        sock, port = _bind(cfg)
    except InputError as e:
        return {"error": str(e)}
    # every session's uploads under one directory, which terminate() removes with the server
    cfg = dataclasses.replace(cfg, work_root=tempfile.mkdtemp(prefix="hgrt-rpc-server-"))
    # daemon: the server process ends when the process that started it does
    threading.Thread(target=_run_loop, args=(sock, port, cfg), name="hgrt-rpc-listen",
                     daemon=True).start()
    return {"port": port, "work_root": cfg.work_root}


class RPCServer:
    """A listen loop in its own process, as ``tvm.rpc.Server`` runs one: ``.host``, ``.port``
    (the one bound), ``.join()`` (returns when the server process ends), ``.terminate()``
    (ends it with its session processes).

    >>> cfg = ListenConfig("127.0.0.1", 9090, 9199, allow=parse_allow(["127.0.0.2"]))
    >>> server = RPCServer(cfg)         # doctest: +SKIP
    >>> server.port, server.terminate()  # doctest: +SKIP
    """

    def __init__(self, cfg: ListenConfig):
        if getattr(_ffi_api, "ServerLoop", None) is None:
            raise RuntimeError("this TVM is built without RPC (USE_RPC=1)")
        self.host = cfg.host
        self.work_root: str | None = None
        self.proc = PopenWorker()
        self.proc.send(_start, [cfg])
        started = self.proc.recv()
        if "error" in started:
            self.terminate()
            raise InputError(started["error"])
        self.port: int = started["port"]
        self.work_root: str = started["work_root"]  # the sessions' uploads, removed at the end

    def join(self) -> None:
        if self.proc is not None:
            self.proc.join()

    def terminate(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # its children first (the session process), then itself
            self.proc = None
            if self.work_root is not None:  # what sessions left there
                shutil.rmtree(self.work_root, ignore_errors=True)

    def __del__(self):
        try:
            self.terminate()
        except ImportError:  # interpreter shutdown
            pass
