"""Real RPC processes for the tests: a TVM tracker and hgrt rpc-servers on 127.0.0.1.

Ports are picked free at run time; every process started here is stopped at the end with its
whole tree (the servers' popen_worker and per-session children included).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil
import pytest

from hgrt.rpc.session import tracker_summary

START_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    popen: subprocess.Popen
    log: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> list[psutil.Process]:
        """SIGKILL the process and all its descendants (children first), reap them, and return
        them (to check that none survived)."""
        procs = self.tree()
        for p in reversed(procs):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.popen.wait(timeout=5)  # reap our direct child
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5  # the others are reaped by whoever adopted them
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        return procs

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()


def _spawn(args: list[str], log: str) -> Proc:
    with open(log, "w") as out:
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(popen, log)


def _wait(cond, what: str, proc: Proc, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.popen.returncode}:\n{proc.output()}")
        try:
            if cond():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout} s:\n{proc.output()}")


@dataclass
class RPCEnv:
    tracker: str
    key: str
    procs: list[Proc]
    tmp: str

    def start_server(self, key: str) -> Proc:
        """Start `hgrt rpc-server` registered under ``key``; returns once the tracker lists it."""
        port = free_port()
        proc = _spawn([sys.executable, "-m", "hgrt.cli", "rpc-server", "--tracker", self.tracker,
                       "--key", key, "--host", "127.0.0.1", "--port", str(port),
                       "--port-end", str(port + 50)],
                      os.path.join(self.tmp, f"server-{key}.log"))
        self.procs.append(proc)
        self.wait_free(key, proc)
        return proc

    def wait_free(self, key: str, proc: Proc, timeout: float = START_TIMEOUT) -> None:
        def free():
            queue = tracker_summary(self.tracker, timeout=2.0)["queue_info"].get(key)
            return queue is not None and queue["free"] > 0

        _wait(free, f"hgrt rpc-server (key {key!r})", proc, timeout)


@pytest.fixture(scope="session")
def rpc_env(tmp_path_factory):
    """A tracker and one hgrt rpc-server (key 'hgrt-test'); more servers via start_server."""
    tmp = str(tmp_path_factory.mktemp("rpc"))
    port = free_port()
    tracker = _spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                      "--port", str(port), "--port-end", str(port + 1), "--silent"],
                     os.path.join(tmp, "tracker.log"))
    env = RPCEnv(f"127.0.0.1:{port}", "hgrt-test", [tracker], tmp)
    try:
        _wait(lambda: tracker_summary(env.tracker, timeout=1.0) is not None, "rpc tracker",
              tracker)
        env.start_server(env.key)
        yield env
    finally:
        stopped = [p for proc in reversed(env.procs) for p in proc.kill()]
        alive = [p.pid for p in stopped if _alive(p)]
        assert not alive, f"processes left running: {alive}"


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    """The elementwise test library, exported once per test module."""
    from hgrt.testing import elementwise_lib

    path = str(tmp_path_factory.mktemp("lib") / "lib.so")
    elementwise_lib().export_library(path)
    return path
