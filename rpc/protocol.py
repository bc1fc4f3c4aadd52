"""hgrt's protocol over TVM RPC: the functions a server registers, the module methods a
client may fetch, how an hgrt error crosses, and the ``HOST:PORT`` address form. The bytes hgrt
lays out itself (inbox frames, stage specs and replies, tensors as bytes) are ``hgrt.rpc.wire``.

Client and server both import this module. The client imports the server only to register
hgrt's functions in its own process, for a ``tvm.rpc.LocalSession``; the server imports nothing
of the client.

What crosses TVM RPC: str, bytes, scalars, Devices, remote tensors and modules (not lists, dicts
or local tensors), so configuration and descriptions travel as JSON strings and numpy data as
bytes. TVM turns a Python exception raised in a remote function into a plain RuntimeError that
carries the message; the hgrt class travels in it (``[hgrt:GraphError] ...``) and the client
raises that class again.
"""

from __future__ import annotations

import re

import hgrt.errors as errors
from hgrt.errors import HgrtError, InputError, RemoteError

CREATE_FUNC = "hgrt.remote.create"  # (graph_json, lib, *devices) -> method(name) -> Function
PLATFORM_FUNC = "hgrt.remote.platform"  # () -> JSON {"machine", "system", "tvm", "hgrt"}
PING_FUNC = "hgrt.remote.ping"  # () -> 0: one bare round trip
STATS_FUNC = "hgrt.remote.stats"  # () -> JSON {"modules", "module_bytes", "rss_bytes"}
INBOX_FUNC = "hgrt.remote.inbox"  # () -> JSON {"address", "port", "token"}: the session's inbox
OUTBOX_FUNC = "hgrt.remote.outbox"  # (host, port, token_hex) -> id: a link to another inbox
OUTBOX_CLOSE_FUNC = "hgrt.remote.outbox_close"  # (id) -> 0
# The methods of a remote module, fetched once each by the client.
METHODS = ("info", "run", "set_input_bytes", "set_input_tensor", "get_input", "get_input_bytes",
           "get_input_into", "get_output", "get_output_bytes", "get_output_into", "load_params",
           "share_params", "benchmark", "close", "run_mode", "infer", "invoke", "run_stage",
           "announce")

ERROR_TAG = "[hgrt:"
_TAGGED = re.compile(re.escape(ERROR_TAG) + r"(\w+)\] (.*)", re.DOTALL)


def encode_error(e: BaseException) -> str:
    """The message that carries ``e``'s hgrt class across RPC (a foreign error: RemoteError)."""
    name = "RemoteError"
    for cls in type(e).__mro__:  # a subclass defined elsewhere travels as its hgrt base
        if cls.__module__ == errors.__name__ and issubclass(cls, HgrtError):
            name = cls.__name__
            break
    detail = str(e) if isinstance(e, HgrtError) else f"{type(e).__name__}: {e}"
    return f"{ERROR_TAG}{name}] {detail}"


def decode_error(e: BaseException, where: str) -> HgrtError | None:
    """The hgrt error a server raised, from the exception a remote call ended in; None when the
    call failed for another reason (the connection)."""
    m = _TAGGED.search(str(e))
    if m is None:
        return None
    cls = getattr(errors, m.group(1), None)
    if not (isinstance(cls, type) and issubclass(cls, HgrtError)):
        cls = RemoteError
    msg = m.group(2).strip()
    return cls(f"{msg} (in {where})" if cls is RemoteError else msg)


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"host:port"`` -> ``("host", port)``."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InputError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:9190), got {address!r}")
    return host, int(port)
