"""Pipelines over boards: one board running the whole model, K boards pipelined (a stage each),
and K boards each running the whole model (data parallel); throughput, latency, memory per board.

A board is an `hgrt rpc-server` on loopback held to one core (`taskset -c k`, TVM_NUM_THREADS=1)
behind a real TVM tracker; this process, the client, shares the cores. Latency is one input
alone; throughput streams ``--inputs`` inputs (the pipeline through its queues, data parallel
with one caller thread per board). The stages' estimated and measured times are printed too.

    python python/bench_pipeline.py [--models squeezenet resnet50] [--inputs 40] [--markdown F]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
from bench_common import light, median_time, run_threads, table

import hgrt
import hgrt.rpc
from hgrt.pipelines import load_pipeline
from hgrt.rpc.session import tracker_summary
from hgrt.stages import split


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Boards:
    """A tracker and ``n`` rpc-servers, server k pinned to core k % cores."""

    def __init__(self, n: int, log_dir: str) -> None:
        self.procs: list[subprocess.Popen] = []
        port = _port()
        self.tracker = f"127.0.0.1:{port}"
        self._spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                     "--port", str(port), "--port-end", str(port + 1), "--silent"],
                    os.path.join(log_dir, "tracker.log"), {})
        self._wait(lambda: tracker_summary(self.tracker, timeout=1.0) is not None)
        cores = sorted(os.sched_getaffinity(0))
        self.keys = []
        for k in range(n):
            key, sport = f"board{k}", _port()
            self._spawn(["taskset", "-c", str(cores[k % len(cores)]), sys.executable, "-m",
                         "hgrt.cli", "rpc-server", "--tracker", self.tracker, "--key", key,
                         "--host", "127.0.0.1", "--port", str(sport), "--port-end",
                         str(sport + 50)], os.path.join(log_dir, f"{key}.log"),
                        {"TVM_NUM_THREADS": "1"})
            self.keys.append(key)
            self._wait(lambda key=key: (tracker_summary(self.tracker, timeout=2.0)
                                        ["queue_info"].get(key, {}).get("free", 0) > 0))

    def _spawn(self, args: list[str], log: str, env: dict) -> None:
        with open(log, "w") as f:
            self.procs.append(subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                               env={**os.environ, **env}))

    @staticmethod
    def _wait(cond, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if cond():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError("a tracker or rpc-server did not start")

    def session(self, k: int):
        return hgrt.rpc.connect(tracker=self.tracker, key=self.keys[k], timeout=60)

    def stop(self) -> None:
        """Kill the servers and the tracker with their children (each runs its loop in a
        worker process of its own, which a kill of the parent alone leaves listening)."""
        import psutil

        for p in reversed(self.procs):
            try:
                children = psutil.Process(p.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for c in [p, *children]:
                c.kill()
            p.wait()
            psutil.wait_procs(children, timeout=10)


def _latency_ms(call, x, n: int = 10) -> float:
    return 1e3 * median_time(lambda: call(x), n)


def _throughput(calls: list, xs: list) -> float:
    """Inputs per second with one caller thread per entry of ``calls`` sharing ``xs``."""
    parts = [xs[k::len(calls)] for k in range(len(calls))]
    jobs = [lambda c=c, p=p: [c(x) for x in p] for c, p in zip(calls, parts, strict=True)]
    return len(xs) / run_threads(jobs)


def bench(name: str, boards: Boards, k: int, n_inputs: int, kernels: str, tmp: str) -> list[str]:
    mdl = light(name)
    x = mdl.inputs
    xs = [x] * n_inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = hgrt.build(mdl.model, ["cpu"], kernels=kernels)
    whole_dir, pipe_dir = os.path.join(tmp, f"{name}_whole"), os.path.join(tmp, f"{name}_pipe")
    one_dir = os.path.join(tmp, f"{name}_one")
    hgrt.save(whole_dir, whole)
    rows = []
    sessions = [boards.session(j) for j in range(k)]  # a server serves one session at a time
    # the rates the split estimates with: `hgrt profile --json` of the whole model as a board
    # runs it (one core, one thread)
    rates = os.path.join(tmp, f"{name}_rates.json")
    cores = sorted(os.sched_getaffinity(0))
    subprocess.run(["taskset", "-c", str(cores[-1]), sys.executable, "-m", "hgrt.cli", "profile",
                    whole_dir, "--random-inputs", "--repeat", "5", "--json", rates],
                   check=True, stdout=subprocess.DEVNULL, env={**os.environ,
                                                               "TVM_NUM_THREADS": "1"})
    # one board, the whole model
    one = hgrt.load(whole_dir, ["cpu"], session=sessions[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = split(mdl.model, k, kernels=kernels, rates=rates, link_bytes_per_s=LINK[0])
    res.save(pipe_dir)
    want = one(x)[0]
    lat1 = _latency_ms(one, x)
    thr1 = _throughput([one], xs)
    # K boards each running the whole model
    many = [one] + [hgrt.load(whole_dir, ["cpu"], session=sessions[j]) for j in range(1, k)]
    thr_dp = _throughput(many, xs)
    for m in many:
        m.close()
    # the same, each board's input through its inbox (a one-stage pipeline per board)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split(mdl.model, 1, kernels=kernels).save(one_dir)
    ones = [load_pipeline(one_dir, [sessions[j]]) for j in range(k)]
    lat1_in = _latency_ms(ones[0], x)
    thr1_in = _throughput(ones[:1], xs)
    thr_dp_in = _throughput(ones, xs)
    for p in ones:
        p.close()
    # K boards pipelined, tensors through the client
    with load_pipeline(pipe_dir, sessions, transfer="client") as p:
        lat_pc = _latency_ms(p, x)
        t0 = time.perf_counter()
        for _ in p.map(xs):
            pass
        thr_pc = n_inputs / (time.perf_counter() - t0)
    # K boards pipelined, board to board
    with load_pipeline(pipe_dir, sessions) as p:
        got = p(x)[0]
        lat_p = _latency_ms(p, x)
        t0 = time.perf_counter()
        for _ in p.map(xs):
            pass
        thr_p = n_inputs / (time.perf_counter() - t0)
        stage_ms = p.stage_ms()  # each board's own time per input, from the stream
    diff = float(np.max(np.abs(got - want)))
    weights = [f"{pl.weight_bytes / 2**20:.1f}" for pl in res.plans]
    w = whole_weight_mib(whole)
    base = max(thr1, thr1_in)  # the better of the two ways to feed one board
    rows += [f"| {name} | one board, whole model (inputs through RPC) | {thr1:.1f} | "
             f"{thr1 / base:.2f} | {lat1:.2f} | {w:.1f} | |",
             f"| {name} | one board, whole model (inputs through its inbox) | {thr1_in:.1f} | "
             f"{thr1_in / base:.2f} | {lat1_in:.2f} | {w:.1f} | |",
             f"| {name} | {k} boards, data parallel (through RPC) | {thr_dp:.1f} | "
             f"{thr_dp / base:.2f} | {lat1:.2f} | {w:.1f} each | |",
             f"| {name} | {k} boards, data parallel (through inboxes) | {thr_dp_in:.1f} | "
             f"{thr_dp_in / base:.2f} | {lat1_in:.2f} | {w:.1f} each | |",
             f"| {name} | {k} boards pipelined, through the client | {thr_pc:.1f} | "
             f"{thr_pc / base:.2f} | {lat_pc:.2f} | {' + '.join(weights)} | |"]
    est = ", ".join(f"{1e3 * pl.estimated_s:.2f}" for pl in res.plans)
    meas = ", ".join(f"{v:.2f}" for v in stage_ms)
    rows.append(f"| {name} | {k} boards pipelined, board to board | {thr_p:.1f} | "
                f"{thr_p / base:.2f} | {lat_p:.2f} | {' + '.join(weights)} | stages est. {est} "
                f"ms, measured {meas} ms; max abs diff to one board {diff:.2g} |")
    for r in rows:
        print(r, flush=True)
    del sessions
    return rows


def whole_weight_mib(res) -> float:
    return sum(v.nbytes for v in res.params.values()) / 2**20


def link_bytes_per_s(mib: float = 2.4, n: int = 20) -> float:
    """How fast an inbox takes tensors on this machine (loopback): the split's link speed."""
    from hgrt.rpc.channel import Inbox, Outbox

    inbox = Inbox()
    box = Outbox("127.0.0.1", inbox.port, inbox.token)
    x = np.ones(int(mib * 2**20) // 4, "float32")
    t0 = time.perf_counter()
    run_threads([lambda: [box.send(i, "x", x) for i in range(n)],
                 lambda: [inbox.take(i, ["x"]) for i in range(n)]])
    seconds = time.perf_counter() - t0
    box.close()
    inbox.close()
    return n * x.nbytes / seconds


LINK = [0.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["squeezenet", "resnet50"])
    ap.add_argument("--boards", type=int, default=2)
    ap.add_argument("--inputs", type=int, default=40)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--markdown", help="write the table into this markdown file")
    args = ap.parse_args()
    head = ["| model | how | inputs/s | / best one board | latency ms | weights MiB per board | |",
            "|---|---|---|---|---|---|---|"]
    LINK[0] = link_bytes_per_s()
    print(f"inbox link on loopback: {LINK[0] / 1e6:.0f} MB/s (the split's link_bytes_per_s)")
    with tempfile.TemporaryDirectory(prefix="hgrt_bench_pipeline_") as tmp:
        boards = Boards(args.boards, tmp)
        try:
            table(args.markdown, "bench_pipeline",
                  f"python python/bench_pipeline.py --models {' '.join(args.models)} --boards "
                  f"{args.boards} --inputs {args.inputs} --kernels {args.kernels}", head,
                  lambda: [r for name in args.models for r in
                           bench(name, boards, args.boards, args.inputs, args.kernels, tmp)])
        finally:
            boards.stop()


if __name__ == "__main__":
    main()
