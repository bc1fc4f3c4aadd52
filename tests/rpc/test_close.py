"""close() of a remote module says when the server did not free it: a real tracker and hgrt
rpc-server on 127.0.0.1, whose session process is killed under a module (the connection breaks
as when that process dies of a fault), and a LocalSession whose server-side close fails once."""

from __future__ import annotations

import logging

import numpy as np
import psutil
import pytest
import tvm

import hgrt
import hgrt.rpc
from hgrt.rpc import server as rpc_server
from hgrt.testing import N, add_one_chain

pytestmark = pytest.mark.rpc

KEY = "hgrt-close"
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def server(rpc_env):
    return rpc_env.start_server(KEY)


def open_module(rpc_env, server, lib_path):
    """A module in a new RPC session of ``server`` that has run once, and the session's
    processes (what the server's process tree gained)."""
    rpc_env.wait_free(KEY, server)  # the server is back once a killed session is reaped
    before = {p.pid for p in server.tree()}
    remote = hgrt.rpc.connect(tracker=rpc_env.tracker, key=KEY, timeout=TIMEOUT)
    m = hgrt.create(add_one_chain(N, 2).json(), lib_path, [remote.cpu(0)])
    x = np.arange(N, dtype="float32")
    np.testing.assert_array_equal(m(x=x)[0], x + 2)
    procs = [p for p in server.tree() if p.pid not in before]
    assert procs, "the session's process was not found in the server's process tree"
    return m, procs


def hgrt_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hgrt")]


def kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=5)


def test_a_close_the_server_does_not_confirm_raises_names_the_module_and_logs(
        rpc_env, server, lib_path, caplog):
    m, procs = open_module(rpc_env, server, lib_path)
    kill(procs)
    with caplog.at_level(logging.WARNING, logger="hgrt"):
        with pytest.raises(hgrt.RemoteError, match=rf"key '{KEY}', server 127\.0\.0\.1:\d+\): "
                           rf"the server did not confirm freeing remote module {m._id} ") as info:
            m.close()
    assert info.value.__cause__ is not None  # the RPC failure, chained
    assert "the RPC session is lost" in str(info.value)
    assert hgrt_logged(caplog) == [str(info.value)]
    assert m.closed
    with pytest.raises(hgrt.ClosedError):
        m(x=np.zeros(N, "float32"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hgrt"):
        m.close()  # nothing left to retry: it says so, and does not raise again
        m.close()
    (logged,) = hgrt_logged(caplog)
    assert f"key '{KEY}'" in logged and "was not freed by close(): the RPC session was lost" \
        in logged


def test_a_with_block_left_by_an_exception_keeps_it_and_logs_the_failed_close(
        rpc_env, server, lib_path, caplog):
    m, procs = open_module(rpc_env, server, lib_path)
    with caplog.at_level(logging.WARNING, logger="hgrt"):
        with pytest.raises(KeyError, match="in the block"):
            with m:
                kill(procs)
                raise KeyError("in the block")
    assert m.closed
    assert f"did not confirm freeing remote module {m._id}" in caplog.text


def alive() -> int:
    return sum(1 for s in list(rpc_server._MODULES.values()) if s.module is not None)


def test_a_close_the_server_refused_is_retried_by_the_next(lib_path, monkeypatch, caplog):
    """The server answers but its close fails (injected once): the module stays alive there,
    close() raises, and close() again frees it."""
    session = tvm.rpc.LocalSession()
    m = hgrt.create(add_one_chain(N, 2).json(), lib_path, [session.cpu(0)])
    before = alive()
    real_close = rpc_server.RemoteModuleServer.close
    fail = [True]

    def close_once(self):
        if fail.pop() if fail else False:
            raise MemoryError("injected")
        real_close(self)

    monkeypatch.setattr(rpc_server.RemoteModuleServer, "close", close_once)
    with caplog.at_level(logging.WARNING, logger="hgrt"):
        with pytest.raises(hgrt.RemoteError, match=rf"module {m._id} .*MemoryError: injected.*"
                           r"close\(\) again retries") as info:
            m.close()
    assert info.value.__cause__ is not None and caplog.records
    assert m.closed and alive() == before  # still alive in the server
    with pytest.raises(hgrt.ClosedError):
        m.run(x=np.zeros(N, "float32"))
    m.close()
    assert alive() == before - 1
    m.close()  # freed: twice is fine
