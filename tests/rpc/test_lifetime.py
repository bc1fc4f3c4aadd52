"""Modules are freed when their user drops or closes them: locally, in a LocalSession, and in a
real server's session process (soak: many create/run/drop cycles stay flat)."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import tvm

import hgrt
import hgrt.rpc
from hgrt.rpc import server as rpc_server
from hgrt.rpc.server import rss_bytes
from hgrt.testing import GraphBuilder, N, elementwise_lib

MIB = 1 << 20
POOL = 32 * MIB  # each module allocates this on device 0, so a leak shows at once


def big_graph() -> str:
    g = GraphBuilder()
    x = g.input("x", dev=0)
    w = g.input("w", dev=1, param=True)
    y = g.op("mul", [g.copy(g.op("add_one", [x], dev=0), dev=1), w], dev=1)
    g.output(g.op("add", [g.copy(y, dev=0), x], dev=0))
    doc = g.doc(pools=True)
    doc["hgrt"]["pool_bytes"][0] = POOL  # larger than needed: a valid plan, and a big one
    return json.dumps(doc)


def cycle(devices, lib, x, w) -> np.ndarray:
    m = hgrt.create(big_graph(), lib, devices)
    m.load_params({"w": w})
    m.run(x=x)
    return m.get_output(0).numpy()  # the module is dropped on return


@pytest.fixture(scope="module")
def session():
    return tvm.rpc.LocalSession()


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lib") / "lib.so")
    elementwise_lib().export_library(path)
    return path


def alive() -> int:
    gc.collect()
    return sum(1 for s in list(rpc_server._MODULES.values()) if s.module is not None)


def test_dropped_remote_modules_are_freed(session, lib_path, rng):
    lib = hgrt.rpc.upload(session, lib_path)
    x, w = rng.standard_normal(N).astype("float32"), rng.standard_normal(N).astype("float32")
    before = alive()
    for _ in range(3):
        y = cycle([session.cpu(0), session.cpu(1)], lib, x, w)
        np.testing.assert_allclose(y, (x + 1) * w + x, rtol=1e-6)
    assert alive() == before  # no reference cycle through FFI functions keeps them
    assert hgrt.rpc.stats(session)["modules"] == before


@pytest.mark.parametrize("where", ["local", "remote"])
def test_close_frees_now_and_later_calls_are_closed_errors(where, session, lib_path, tmp_path,
                                                           rng):
    art = hgrt.save(str(tmp_path / "art"), big_graph(), elementwise_lib(),
                    {"w": np.ones(N, "float32")})
    kw = {"session": session} if where == "remote" else {}
    before = alive()
    with hgrt.load(art, ["cpu:0", "cpu:1"], **kw) as m:
        m.run(x=np.zeros(N, "float32"))
        assert m.device_bytes[0] == POOL
        if where == "remote":
            assert alive() == before + 1
    assert m.closed and alive() == before
    for call in (m.run, lambda: m.set_input("x", np.zeros(N, "float32")),
                 lambda: m.get_output(0), lambda: m.get_input("x")):
        with pytest.raises(hgrt.ClosedError, match="is closed"):
            call()
    m.close()  # twice is fine


def test_local_create_drop_and_runs_stay_flat(lib_path, rng):
    lib = tvm.runtime.load_module(lib_path)
    x, w = rng.standard_normal(N).astype("float32"), rng.standard_normal(N).astype("float32")
    devs = [tvm.cpu(0), tvm.cpu(1)]
    cycle(devs, lib, x, w)
    start = rss_bytes()
    for _ in range(30):
        cycle(devs, lib, x, w)
    grown = rss_bytes() - start
    assert grown < 2 * POOL, f"30 create/drop cycles grew RSS by {grown / MIB:.1f} MiB"
    m = hgrt.create(big_graph(), lib, devs)
    m.load_params({"w": w})
    m.run(x=x)
    start = rss_bytes()
    for _ in range(1000):
        m.run()
    assert rss_bytes() - start < 4 * MIB


def soak(rpc_env, lib_path, rng, cycles: int) -> dict:
    remote = hgrt.rpc.connect(tracker=rpc_env.tracker, key=rpc_env.key, timeout=60)
    lib = hgrt.rpc.upload(remote, lib_path)
    x, w = rng.standard_normal(N).astype("float32"), rng.standard_normal(N).astype("float32")
    devs = [remote.cpu(0), remote.cpu(1)]
    for _ in range(3):  # warm up: the session's first allocations and imports
        cycle(devs, lib, x, w)
    start = hgrt.rpc.stats(remote)
    for _ in range(cycles):
        np.testing.assert_allclose(cycle(devs, lib, x, w), (x + 1) * w + x, rtol=1e-6)
    gc.collect()
    end = hgrt.rpc.stats(remote)
    return {"start": start, "end": end, "grown_mib": (end["rss_bytes"] - start["rss_bytes"]) / MIB}


@pytest.mark.rpc
def test_remote_soak_short(rpc_env, lib_path, rng):
    res = soak(rpc_env, lib_path, rng, cycles=10)
    assert res["end"]["modules"] == 0 and res["end"]["module_bytes"] == 0
    assert res["grown_mib"] < 2 * POOL / MIB, res  # leaking modules would add 320 MiB


@pytest.mark.rpc
@pytest.mark.slow
def test_remote_soak_50_cycles(rpc_env, lib_path, rng):
    res = soak(rpc_env, lib_path, rng, cycles=50)
    print(f"remote soak: 50 cycles of a {POOL // MIB} MiB module, server session RSS "
          f"{res['start']['rss_bytes'] / MIB:.1f} -> {res['end']['rss_bytes'] / MIB:.1f} MiB, "
          f"live modules after: {res['end']['modules']}")
    assert res["end"]["modules"] == 0
    assert res["grown_mib"] < 2 * POOL / MIB, res
