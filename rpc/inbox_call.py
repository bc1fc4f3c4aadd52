"""A remote module's calls through its RPC session's inbox: the inputs over a plain socket, the
outputs back in the RPC reply.

TVM RPC moves a tensor's bytes at about 50 MB/s on loopback, CPU-bound in the client; a plain
socket moves them at about 1 GB/s. So a call (``m(x=...)``, ``m.infer``) sends its inputs to the
session's inbox (``hgrt.rpc.channel``) as one announced stream of the module's own, numbered in
call order, and then runs them as a one-stage pipeline would (``run_stage``): the module's
outputs come back in that call's reply. Outputs are usually far smaller than inputs; they still
cross TVM RPC.

The inbox is used where it answers as the inbox: the client connects to the address it reached
the board at and waits for the token's acknowledgement (wire version 2). Where that fails (an
older server, a board behind an SSH tunnel whose inbox port is not forwarded, a closed port, an
unrelated service), the module's calls go through TVM RPC, as before, with one log line; a call
never fails for it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence

import numpy as np

from hgrt.errors import HgrtError, InputError, RemoteError
from hgrt.rpc import channel, wire

__all__ = ["CALL_TIMEOUT", "TRANSFERS", "CallTransfer", "InboxCall"]

log = logging.getLogger("hgrt.rpc")

CALL_TIMEOUT = 10.0  # seconds a call's stage waits for its tensors (they were sent before it)
TRANSFERS = ("auto", "inbox", "rpc")
OUTPUT = "output:{}"  # names of the module's outputs in a call's stage spec


class InboxCall:
    """One module's stream in its session's inbox: ``send`` sends the next call's tensors,
    ``spec_json`` is what ``run_stage`` takes for it. The caller holds the session's lock around
    both, so that the inbox sees the inputs in the order the stage takes them."""

    def __init__(self, outbox: channel.Outbox, stream: str, names: dict[int, str],
                 spec_json: str) -> None:
        self.outbox, self.stream, self.names, self.spec_json = outbox, stream, names, spec_json
        self.seq = 0  # the next input's number in the stream

    def send(self, arrays: dict[int, np.ndarray]) -> int:
        """Send the inputs (by index) of the next call; its number. ``RemoteError`` when the
        inbox is gone (nothing of the call ran)."""
        seq = self.seq
        self.seq += 1
        for index, name in self.names.items():
            self.outbox.send(seq, name, arrays[index], self.stream)
        return seq

    def close(self) -> None:
        self.outbox.close()


def call_spec(names: dict[int, str], outputs: int) -> dict:
    """The stage spec of a call: the inputs taken by name, the outputs returned."""
    outs = [OUTPUT.format(i) for i in range(outputs)]
    stream = f"call-{secrets.token_hex(8)}"
    spec = wire.stage_spec(list(names.values()), outs, stream,
                           {n: i for i, n in names.items()}, [], wire.NO_LINK, outs)
    spec["timeout"] = CALL_TIMEOUT
    return spec


def open_inbox_call(module, names: dict[int, str]) -> InboxCall:
    """A stream of ``module``'s own in its session's inbox, announced, its connection checked
    (the inbox acknowledged the token); ``HgrtError`` saying why not."""
    with module.session.lock:
        where = module.inbox()
    outbox = channel.Outbox(where.host, where.port, where.token, verify=True)
    try:
        spec = call_spec(names, len(module.graph.heads))
        module.announce(wire.announcement(spec, {}, 1, 0))  # one input at a time, in order
        return InboxCall(outbox, spec["stream"], names, wire.encode_stage_spec(spec))
    except BaseException:
        outbox.close()
        raise


class CallTransfer:
    """How one remote module's calls move their tensors: ``mode`` "auto" (the inbox where it
    answers, else TVM RPC), "inbox" (the inbox or a ``RemoteError``) or "rpc"."""

    def __init__(self, local: bool) -> None:
        self.mode = "auto"
        self._local = local
        self._why_not: str | None = "the session is in this process" if local else None
        self._call: InboxCall | None = None
        self._opening = threading.Lock()  # one thread opens the stream, the others wait
        self._closed = False

    @property
    def path(self) -> str:
        """"inbox" or "rpc": what the next call uses ("inbox" until it is found unreachable)."""
        return "rpc" if self.mode == "rpc" or self._why_not is not None else "inbox"

    def configure(self, mode: str) -> None:
        if mode not in TRANSFERS:
            raise InputError(f"transfer must be one of {TRANSFERS}, got {mode!r}")
        self.mode = mode
        if mode == "inbox" and not self._local:
            self._why_not = None  # try the inbox again

    def infer(self, module, items: Sequence[tuple[int, np.ndarray]],
              rpc: Callable[[], bytes], stage: Callable[[int, str], bytes]) -> bytes:
        """The outputs' bytes of one call of ``module`` (the RemoteGraphModule that holds this)
        on ``items`` (input index, array): through the inbox and ``stage(seq, spec)``, or
        ``rpc()``. The caller holds no lock."""
        box = self._ready(module)
        if box is None:
            return rpc()
        try:
            with module.session.lock:  # inputs numbered in the order stages take them
                seq = box.send(dict(items))
                return stage(seq, box.spec_json)
        except RemoteError as e:
            if module.session.lost is not None:
                self._drop(box)
                raise
            self._give_up(module, box, e)  # the tensors did not reach the stage: nothing ran
        except HgrtError:
            self._drop(box)  # the stream may hold this call's tensors: the next opens anew
            raise
        return rpc()

    def _ready(self, module) -> InboxCall | None:
        """The module's stream in the inbox, opened on the first call; None: use RPC."""
        if self.path == "rpc":
            return None
        box = self._call
        if box is not None:
            return box
        with self._opening:
            if self._call is None and self._why_not is None and not self._closed:
                try:
                    self._call = open_inbox_call(module, _names(module.graph))
                except HgrtError as e:
                    if module.session.lost is not None:
                        return None  # the RPC call says so
                    self._give_up(module, None, e)
            if self._closed and self._call is not None:
                self._call.close()
                self._call = None
            return self._call

    def _give_up(self, module, box: InboxCall | None, e: HgrtError) -> None:
        """Calls go through TVM RPC from now on (or, in mode "inbox", this one fails)."""
        self._drop(box)
        why = str(e)
        if self.mode == "inbox":
            raise RemoteError(f"{module.session.name}: a call through the inbox failed: "
                              f"{why}") from e
        if self._why_not is None:
            self._why_not = why
            log.info("%r: calls go through TVM RPC, not the session's inbox: %s", module,
                     why)

    def _drop(self, box: InboxCall | None) -> None:
        if box is not None:
            box.close()
            if self._call is box:
                self._call = None

    def close(self) -> None:
        """Close the module's connection to the inbox (the module was closed)."""
        self._closed = True
        box, self._call = self._call, None
        if box is not None:
            box.close()


def _names(g) -> dict[int, str]:
    """The names of graph ``g``'s user inputs by input index; ``InputError`` for a dtype that an
    inbox does not carry."""
    names = {}
    for index, nid in enumerate(g.arg_nodes):
        name = g.nodes[nid].name
        if name in g.params:
            continue
        dtype = str(g.dtypes[g.entry_id(nid)])
        if dtype not in wire.DTYPES:
            raise InputError(f"input {name!r} is {dtype}, which an inbox does not carry")
        names[index] = name
    return names
