"""Remote execution cost on loopback: RPC round trips per call, and remote run() minus local run().

    python python/bench_rpc.py [--runs 2000] [--chain 100]

Starts an hgrt rpc-server (standalone, 127.0.0.1, free port) in this machine, then:

1. Round trips, counted on the wire: the client talks to the server through a TCP relay that
   parses TVM's RPC framing (after the handshake every message is an 8-byte length + body) and
   counts the messages the client sends. Target: 1 per run().
2. Time: the same graph, same kernels, run locally (hgrt.create on tvm.cpu(0), tvm.cpu(1)) and
   remotely (remote.cpu(0), remote.cpu(1), direct connection without the relay); the difference
   is what remote execution adds to one run(). The server-side benchmark() is printed as well:
   it should match the local figure.
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
import argparse
import gc
import multiprocessing
import os
import socket
import statistics
import struct
import tempfile
import threading
import time

import numpy as np
import tvm

import hgrt
import hgrt.rpc
from hgrt.rpc.server import PING_FUNC, serve
from hgrt.testing import GraphBuilder, N, elementwise_lib


class CountingRelay:
    """A TCP relay that counts the RPC messages the client sends (one per remote call).

    It runs in its own process: a TVM call blocks in C++ without releasing the GIL, so a relay
    thread in the client's process could not forward the very message the client waits on.
    """

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        ctx = multiprocessing.get_context("fork")  # the relay only touches sockets
        self._sent = ctx.Value("q", 0)  # client -> server messages after the handshake
        self._received = ctx.Value("q", 0)  # server -> client messages after the handshake
        self.proc = ctx.Process(target=self._accept, daemon=True)
        self.proc.start()
        self.listener.close()

    @property
    def sent(self) -> int:
        return self._sent.value

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join()

    def _accept(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=self._pump, args=(server, client, False), daemon=True)
        back.start()
        self._pump(client, server, True)
        back.join()

    @staticmethod
    def _read(sock, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return bytes(buf)

    def _pump(self, src, dst, from_client: bool):
        try:
            # handshake: client sends magic, key length, key; server answers code, len, key
            if from_client:
                head = self._read(src, 8)
                dst.sendall(head + self._read(src, struct.unpack("<i", head[4:])[0]))
            else:
                code = self._read(src, 4)
                dst.sendall(code)
                keylen = self._read(src, 4)
                dst.sendall(keylen + self._read(src, struct.unpack("<i", keylen)[0]))
            while True:
                size = self._read(src, 8)
                body = self._read(src, struct.unpack("<Q", size)[0])
                counter = self._sent if from_client else self._received
                with counter.get_lock():
                    counter.value += 1
                dst.sendall(size + body)
        except (ConnectionError, OSError):
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def two_device_graph() -> str:
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    b = g.copy(g.op("add_one", [x], dev=0), dev=1)
    y = g.op("mul", [b, w], dev=1)
    g.output(g.op("add", [g.copy(y, dev=0), x], dev=0), y)
    return g.json(pools=True)


def chain_graph(steps: int) -> str:
    """``steps`` kernels alternating between cpu:0 and cpu:1 (a copy at each switch)."""
    g = GraphBuilder()
    x = g.input("x", dev=0)
    for i in range(steps):
        dev = (i // 10) % 2
        if i and i % 10 == 0:
            x = g.copy(x, dev=dev)
        x = g.op("add_one", [x], dev=dev)
    g.output(x)
    return g.json(pools=True)


def mean_seconds(fn, runs: int) -> float:
    for _ in range(min(100, runs)):
        fn()
    reps = []
    per = max(1, runs // 5)
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        reps.append((time.perf_counter() - t0) / per)
    return statistics.median(reps)


def count_round_trips(port: int, lib_path: str, graph_json: str) -> dict[str, float]:
    relay = CountingRelay(("127.0.0.1", port))
    remote = hgrt.rpc.connect(server=f"127.0.0.1:{relay.port}")
    lib = hgrt.rpc.upload(remote, lib_path)
    m = hgrt.create(graph_json, lib, [remote.cpu(0), remote.cpu(1)])
    x = np.ones(N, "float32")
    m.load_params({"w": x})
    m.set_input("x", x)
    m.run()
    out = tvm.runtime.empty((N,), "float32", remote.cpu(0))
    m.get_output(0, out)

    def per_call(fn, n=50):
        gc.collect()
        before = relay.sent
        for _ in range(n):
            fn()
        gc.collect()
        return (relay.sent - before) / n

    counts = {
        "run()": per_call(m.run),
        "set_input(name, numpy)": per_call(lambda: m.set_input("x", x)),
        "get_output(i, out=remote tensor)": per_call(lambda: m.get_output(0, out)),
        "get_output(i) (a remote tensor)": per_call(lambda: m.get_output(0)),
        "load_params(dict)": per_call(lambda: m.load_params({"w": x})),
    }
    relay.stop()
    return counts  # the session closes when m, lib, out and remote go out of scope


def timings(port: int, lib_path: str, graph_json: str, runs: int) -> dict[str, float]:
    local = hgrt.create(graph_json, tvm.runtime.load_module(lib_path), [tvm.cpu(0), tvm.cpu(1)])
    remote = hgrt.rpc.connect(server=f"127.0.0.1:{port}")
    m = hgrt.create(graph_json, hgrt.rpc.upload(remote, lib_path),
                    [remote.cpu(0), remote.cpu(1)])
    for mod in (local, m):
        shapes, _ = mod.get_input_info()
        for name, shape in shapes.items():
            mod.set_input(name, np.ones(shape, "float32"))
        if mod.get_input_index("w") >= 0:
            mod.load_params({"w": np.ones(N, "float32")})
    ping = remote.get_function(PING_FUNC)
    t_ping = mean_seconds(ping, runs)
    t_local = mean_seconds(local.run, runs)
    t_remote = mean_seconds(m.run, runs)
    t_server = m.benchmark(repeat=5, number=max(1, runs // 5)).median
    return {"bare round trip (empty remote func)": t_ping, "local run()": t_local,
            "remote run()": t_remote, "remote - local": t_remote - t_local,
            "server-side benchmark()": t_server}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="run() calls per timing")
    ap.add_argument("--chain", type=int, default=100, help="kernels in the long graph")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="hgrt_bench_rpc_")
    lib_path = os.path.join(tmp, "lib.so")
    elementwise_lib().export_library(lib_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve("127.0.0.1", port, port + 50, silent=True)
    try:
        graphs = {"two-device graph (3 kernels, 2 copies)": two_device_graph(),
                  f"chain of {args.chain} kernels over cpu:0/cpu:1": chain_graph(args.chain)}
        print(f"hgrt {hgrt.__version__}, tvm {tvm.__version__}, loopback 127.0.0.1:"
              f"{server.port}, {os.cpu_count()} cores\n")
        print("RPC messages sent by the client per call (counted on the wire):")
        counts = count_round_trips(server.port, lib_path, next(iter(graphs.values())))
        gc.collect()  # close that session: the server serves one at a time
        for what, n in counts.items():
            print(f"  {what:36s} {n:.2f}")
        print()
        for name, graph_json in graphs.items():
            t = timings(server.port, lib_path, graph_json, args.runs)
            gc.collect()
            print(f"{name}:")
            for what, sec in t.items():
                print(f"  {what:36s} {sec * 1e6:9.1f} us")
            print()
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
