"""An emulated aarch64 board (python/board_aarch64.py: qemu user mode, an arm64 CPython, aarch64
TVM wheels) running a real `hgrt rpc-server` registered with a real tracker: build on x86 for
two aarch64 CPUs, save (cross-linked), load onto the board's devices, run, and compare bitwise
with the same model built for and run on x86. Slow: the board imports TVM in ~13 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tvm
from conftest import RPCEnv, _spawn, _wait, free_port

import hgrt
import hgrt.rpc
from hgrt.rpc.session import library_machine, server_platform, tracker_summary
from hgrt.testing import zoo_input, zoo_model

pytestmark = [pytest.mark.slow, pytest.mark.rpc]

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOARD_SCRIPT = os.path.join(CHECKOUT, "python", "board_aarch64.py")
TAG = "raspberry-pi/4b-aarch64"
KEY = "aarch64-board"
SERVER_START = 240.0  # TVM imports in ~13 s under qemu; allow for a loaded 2-core machine
PLACE = {"nn.conv2d": "cpu:1"}


@pytest.fixture(scope="module")
def board():
    """The prepared board (JSON of python/board_aarch64.py), or a skip saying why not."""
    proc = subprocess.run([sys.executable, BOARD_SCRIPT, "prepare", "--json"],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def board_env(board, tmp_path_factory):
    """A tracker on 127.0.0.1 and the board's hgrt rpc-server registered under KEY."""
    tmp = str(tmp_path_factory.mktemp("board"))
    port = free_port()
    tracker = _spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                      "--port", str(port), "--port-end", str(port + 1), "--silent"],
                     os.path.join(tmp, "tracker.log"))
    env = RPCEnv(f"127.0.0.1:{port}", KEY, [tracker], tmp)
    try:
        _wait(lambda: tracker_summary(env.tracker, timeout=1.0) is not None, "rpc tracker",
              tracker)
        sport = free_port()
        t0 = time.monotonic()
        server = _spawn([sys.executable, BOARD_SCRIPT, "python", "-m", "hgrt.cli", "rpc-server",
                         "--tracker", env.tracker, "--key", KEY, "--host", "127.0.0.1",
                         "--port", str(sport), "--port-end", str(sport + 50)],
                        os.path.join(tmp, "board-server.log"))
        env.procs.append(server)
        env.wait_free(KEY, server, timeout=SERVER_START)
        print(f"aarch64 rpc-server registered after {time.monotonic() - t0:.1f} s")
        yield env
    finally:
        for proc in reversed(env.procs):
            proc.kill()


@pytest.fixture(scope="module")
def squeezenet():
    model = zoo_model("squeezenet", seed=0)
    return model, zoo_input(model, seed=1)


@pytest.fixture(scope="module")
def x86_build(squeezenet):
    """The same model, placement and TVM kernels, built for and run on this x86 machine:
    the build and its output."""
    model, inputs = squeezenet
    res = hgrt.build(model, ["cpu:0", "cpu:1"], placement=hgrt.Placement(rules=PLACE),
                     kernels="tvm")
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0), tvm.cpu(1)])
    m.load_params(res.params)
    m.set_input(**inputs)
    m.run()
    return res, m.get_output(0).numpy()


@pytest.fixture(scope="module")
def x86_output(x86_build):
    return x86_build[1]


def test_build_save_load_run_on_the_board(board_env, squeezenet, x86_output, tmp_path):
    model, inputs = squeezenet
    res = hgrt.build(model, ["cpu:0", "cpu:1"], placement=hgrt.Placement(rules=PLACE),
                     target={"cpu": TAG})
    assert all('"mtriple":"aarch64-linux-gnu"' in t for t in res.targets.values())
    out = str(tmp_path / "sq_arm")
    hgrt.save(out, res)
    assert library_machine(os.path.join(out, "lib.so")) == "aarch64"
    remote = hgrt.rpc.connect(tracker=board_env.tracker, key=KEY, timeout=60)
    assert server_platform(remote)["machine"] == "aarch64"
    with hgrt.load(out, ["cpu:0", "cpu:1"], session=remote) as m:
        m.set_input(**inputs)
        t0 = time.perf_counter()
        m.run()
        print(f"squeezenet split over the board's cpu:0 + cpu:1: run() "
              f"{time.perf_counter() - t0:.2f} s")
        y = m.get_output(0).numpy()
    np.testing.assert_array_equal(y, x86_output)


def test_x86_library_is_refused_by_the_board_with_a_target_to_build_for(board_env, x86_build,
                                                                       tmp_path):
    out = hgrt.save(str(tmp_path / "sq_x86"), x86_build[0])
    remote = hgrt.rpc.connect(tracker=board_env.tracker, key=KEY, timeout=60)
    with pytest.raises(hgrt.RemoteError, match=r"library for x86_64, but the server .* runs "
                                               r"aarch64 .*\"mtriple\": \"aarch64-linux-gnu\""):
        hgrt.load(out, ["cpu:0", "cpu:1"], session=remote)


def test_cli_compile_for_the_board_and_run_there(board_env, squeezenet, x86_output, tmp_path):
    model, inputs = squeezenet
    import onnx

    onnx.save(model, str(tmp_path / "sq.onnx"))
    (name, x), = inputs.items()
    np.save(tmp_path / "x.npy", x)
    out, y_file = str(tmp_path / "out"), str(tmp_path / "y.npz")
    hgrt_cli = [sys.executable, "-m", "hgrt.cli"]
    subprocess.run([*hgrt_cli, "compile", str(tmp_path / "sq.onnx"), "--device", "cpu:0",
                    "--device", "cpu:1", "--place", "nn.conv2d=cpu:1",
                    "--target", f"cpu={TAG}", "-o", out], check=True, timeout=600)
    run = subprocess.run([*hgrt_cli, "run", out, "--input", f"{name}={tmp_path / 'x.npy'}",
                          "--rpc-tracker", board_env.tracker, "--rpc-key", KEY,
                          "--save-output", y_file],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "output 0: shape (1, 1000, 1, 1)" in run.stdout, run.stdout
    np.testing.assert_array_equal(np.load(y_file)["arr_0"], x86_output)


def test_the_board_runs_a_pipeline_stage(board_env, squeezenet):
    """The aarch64 board as the second stage of a pipeline whose first stage is an x86 board
    (a loopback hgrt rpc-server): each stage built for its own CPU, tensors board to board, the
    outputs right against the ONNX file."""
    from hgrt.stages import split
    from hgrt.testing import assert_close_to, reference

    model, inputs = squeezenet
    board_env.start_server("x86-board")
    res = split(model, [{"devices": ["cpu"], "key": "x86-board"},
                        {"devices": ["cpu"], "key": KEY, "target": {"cpu": TAG}}], kernels="tvm")
    assert library_machine_of(res.builds[1]) == "aarch64"
    sessions = [hgrt.rpc.connect(tracker=board_env.tracker, key=k, timeout=60)
                for k in ("x86-board", KEY)]
    want = reference(model, inputs)
    with hgrt.pipeline(res, sessions) as p:
        assert p.transfer == "direct"
        for got in p.map([inputs] * 3):
            assert_close_to(got, want)
        print(f"x86 stage + aarch64 stage: {p.stage_ms()} ms per input")


def library_machine_of(build) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return library_machine(os.path.join(hgrt.save(tmp, build), "lib.so"))
