"""A TCP relay whose upstream connections leave from a chosen source address, for the
``--allow`` tests: ``tvm.rpc.connect`` cannot pick its source address, so a client connects to
this relay on 127.0.0.1 and the server sees the relay's source (127.0.0.2, say).

    python source_relay.py LISTEN_PORT UPSTREAM_HOST:UPSTREAM_PORT SOURCE_ADDRESS

Prints "relay ready" once it listens. It runs as a process of its own: a TVM call holds the GIL
while it waits for the server's answer, so a relay thread in the client's process would stall.
"""

from __future__ import annotations

import socket
import sys
import threading


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):  # one side ended: end both, so the server sees the client leave
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def main(argv: list[str]) -> None:
    port, upstream, source = int(argv[0]), argv[1].rpartition(":"), argv[2]
    listener = socket.create_server(("127.0.0.1", port))
    print("relay ready", flush=True)
    while True:
        client, _ = listener.accept()
        server = socket.create_connection((upstream[0], int(upstream[2])),
                                          source_address=(source, 0))
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(client, server), daemon=True).start()
        threading.Thread(target=_pump, args=(server, client), daemon=True).start()


if __name__ == "__main__":
    main(sys.argv[1:])
