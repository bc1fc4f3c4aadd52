"""One remote call of a model on a loopback board: its inputs through TVM RPC against through the
session's inbox, and the board's own run() time.

    python python/bench_remote.py [--model squeezenet] [--calls 60] [--markdown BENCHMARKS.md]

The board is an `hgrt rpc-server` on 127.0.0.1 (standalone), held to one core (`taskset -c` the
last usable core, TVM_NUM_THREADS=1); this process, the client, is held to the first one. Each
round calls the model once through TVM RPC (``configure_transfer("rpc")``), once through the
inbox (``"inbox"``), and times one run() in the server (``benchmark(1, 1, 0)``), in that order;
the figures are medians over the rounds. The bound a call through the inbox is held to: the
board's run() + the inputs' and outputs' bytes at 1 GB/s + 1 ms.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
from bench_common import light, table

import hgrt
import hgrt.rpc

LINK = 1e9  # bytes per second the bound counts the tensors at
SLACK = 1e-3  # seconds the bound allows beyond the board's run and the bytes


def isa_flags() -> str:
    """The AVX flags of /proc/cpuinfo (``grep -o 'avx[0-9a-z_]*' /proc/cpuinfo | sort -u``)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " ".join(sorted(set(re.findall(r"\bavx[0-9a-z_]*", f.read()))))
    except OSError:
        return "unknown"


def start_board(core: int, log: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(log, "w") as out:
        proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "hgrt.cli",
                                 "rpc-server", "--host", "127.0.0.1", "--port", str(port),
                                 "--port-end", str(port + 50), "--silent"],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TVM_NUM_THREADS": "1"})
    return proc, port


def connect(proc: subprocess.Popen, port: int, timeout: float = 60.0):
    """A session of the board (its port may be a later one of its range)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the rpc-server exited with {proc.returncode}")
        for p in range(port, port + 3):
            try:
                return hgrt.rpc.connect(server=f"127.0.0.1:{p}", timeout=5)
            except hgrt.HgrtError:
                continue
        time.sleep(0.2)
    raise RuntimeError("the rpc-server did not answer")


def stop(proc: subprocess.Popen) -> None:
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for c in [proc, *children]:
        try:
            c.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=10)
    psutil.wait_procs(children, timeout=10)


def rounds(m, x: dict, calls: int) -> dict[str, list[float]]:
    """Seconds of each way per round, interleaved; the outputs of both ways compared."""
    samples: dict[str, list[float]] = {"rpc": [], "inbox": [], "run": []}
    for mode in ("rpc", "inbox"):  # warm-up, and the inbox's stream opened
        m.configure_transfer(mode)
        m(**x)
    for _ in range(calls):
        outs = {}
        for mode in ("rpc", "inbox"):
            m.configure_transfer(mode)
            t = time.perf_counter()
            outs[mode] = m(**x)
            samples[mode].append(time.perf_counter() - t)
        samples["run"].append(m.benchmark(1, 1, 0).results[0])
        for a, b in zip(outs["rpc"], outs["inbox"], strict=True):
            if not np.array_equal(a, b):
                raise RuntimeError("the outputs through the inbox differ from RPC's")
    return samples


def bench(name: str, calls: int, kernels: str, tmp: str) -> list[str]:
    mdl = light(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        art = hgrt.save(os.path.join(tmp, name), hgrt.build(mdl.model, ["cpu"], kernels=kernels))
    cores = sorted(os.sched_getaffinity(0))
    proc, port = start_board(cores[-1], os.path.join(tmp, "board.log"))
    os.sched_setaffinity(0, {cores[0]})
    try:
        remote = connect(proc, port)
        with hgrt.load(art, ["cpu"], session=remote) as m:
            x = mdl.inputs
            out_bytes = sum(o.nbytes for o in m(**x))
            in_bytes = sum(v.nbytes for v in x.values())
            m.set_input(x)  # what the board's run() runs on
            s = rounds(m, x, calls)
            assert m.transfer == "inbox"
        del remote
    finally:
        os.sched_setaffinity(0, set(cores))
        stop(proc)
    med = {k: 1e3 * statistics.median(v) for k, v in s.items()}
    bound = med["run"] + 1e3 * ((in_bytes + out_bytes) / LINK + SLACK)
    return [
        f"| {name} | {in_bytes / 1e6:.3f} MB in, {out_bytes / 1e3:.1f} kB out | "
        f"{med['run']:.2f} | {med['rpc']:.2f} | {med['inbox']:.2f} | {bound:.2f} | "
        f"{'yes' if med['inbox'] <= bound else 'no'} | "
        f"{med['inbox'] - med['run']:.2f} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="squeezenet")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--kernels", default="tvm")
    ap.add_argument("--markdown", default=None, help="write the table into this file")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    command = "python python/bench_remote.py " + " ".join(sys.argv[1:])
    head = [f"ISA flags: {isa_flags()}. Board: one core (taskset), TVM_NUM_THREADS=1; client: "
            f"another core. Medians over {args.calls} interleaved rounds, ms.", "",
            "| model | tensors | board run() | call, RPC | call, inbox | bound | within | "
            "inbox call - run() |",
            "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="hgrt_bench_remote_") as tmp:
        table(args.markdown, "bench_remote", command, head,
              lambda: [print(r) or r for r in bench(args.model, args.calls, args.kernels, tmp)])


if __name__ == "__main__":
    main()
