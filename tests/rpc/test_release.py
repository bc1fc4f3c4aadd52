"""A closed pipeline or module lets go of its boards: once the caller drops its own RPC
sessions, hgrt holds none, the session ends and the next client with the same tracker key is
served at once (a real tracker and real `hgrt rpc-server`s on 127.0.0.1). A pipeline dropped
unclosed ends its threads when it is collected."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import hgrt
import hgrt.rpc
from hgrt.pipelines import load_pipeline
from hgrt.testing import conv_model, reference

pytestmark = pytest.mark.rpc
SERVED_WITHIN = 2.0  # seconds the next client may wait for a board released by close()


@pytest.fixture(scope="module")
def conv_pipeline(tmp_path_factory):
    from hgrt.stages import split

    out = tmp_path_factory.mktemp("release") / "conv"
    split(conv_model(), 2, kernels="tvm").save(out)
    return out


def _x() -> dict:
    return {"x": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype("float32")}


def _served_at_once(rpc_env, keys) -> None:
    """A new client of each key is given its board within SERVED_WITHIN seconds."""
    for key in keys:
        t0 = time.monotonic()
        again = hgrt.rpc.connect(tracker=rpc_env.tracker, key=key, timeout=SERVED_WITHIN)
        assert time.monotonic() - t0 < SERVED_WITHIN
        del again


def test_a_closed_pipeline_releases_its_boards(rpc_env, conv_pipeline):
    keys = ("release-a", "release-b")
    for key in keys:
        rpc_env.start_server(key)
    sessions = [hgrt.rpc.connect(tracker=rpc_env.tracker, key=k, timeout=30) for k in keys]
    x = _x()
    with load_pipeline(conv_pipeline, sessions) as p:  # `p` stays bound after the block
        assert p.transfer == "direct"
        np.testing.assert_allclose(p(x)[0], reference(conv_model(), x)[0], rtol=1e-5,
                                   atol=1e-5)
    del sessions
    _served_at_once(rpc_env, keys)
    assert "closed" in repr(p)


def test_a_closed_module_releases_its_board(rpc_env, conv_pipeline):
    key = "release-m"
    rpc_env.start_server(key)
    remote = hgrt.rpc.connect(tracker=rpc_env.tracker, key=key, timeout=30)
    with hgrt.load(os.path.join(conv_pipeline, "stage0"), ["cpu"], session=remote) as m:
        m(x=_x()["x"])  # `m` stays bound after the block
    del remote
    _served_at_once(rpc_env, [key])
    with pytest.raises(hgrt.ClosedError):
        m(x=_x()["x"])
    assert "release-m" in repr(m)  # still named for messages


def test_an_unclosed_pipeline_ends_its_threads_when_collected(conv_pipeline):
    from hgrt.pipelines import load_pipeline as load

    p = load(conv_pipeline)
    p(_x())
    threads = list(p._threads)
    assert all(t.is_alive() for t in threads)
    del p
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.is_alive() for t in threads)
    assert not [t for t in threading.enumerate() if t in threads]
