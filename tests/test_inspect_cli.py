"""hgrt inspect / profile / run on hand-built artifacts, and the memory summary's numbers."""

import json
import os
import re

import numpy as np
import pytest

import hgrt
from hgrt.cli import main
from hgrt.graph import Graph
from hgrt.inspect import inspect_artifacts
from hgrt.lifetimes import align, live_ranges, memory_report
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import GraphBuilder, N, elementwise_lib


def artifact(tmp_path, pools=True):
    g = GraphBuilder()
    x = g.input("x", dev=0, sid=0)
    w = g.input("w", dev=1, sid=1, param=True)
    a = g.op("add_one", [x], dev=0, sids=[2])
    b = g.op("add_one", [a], dev=0, sids=[3])
    c = g.copy(b, dev=1, sid=4)
    d = g.op("mul", [c, w], dev=1, sids=[5])
    g.output(g.op("add", [x, g.copy(d, dev=0, sid=2)], dev=0, sids=[6]))
    doc = g.doc(pools=pools)
    doc["hgrt"]["devices"] = ["cpu:0", "cpu:1"]
    path = str(tmp_path / "art")
    hgrt.save(path, json.dumps(doc), elementwise_lib(), {"w": np.full(N, 2.0, "float32")})
    return path, Graph.from_json(json.dumps(doc))


def brute_force_peak(g, dev):
    peak = 0
    for step in range(-1, len(g.nodes) + 1):
        live = sum(align(max(g.entry_bytes(e) for e in grp.members)) for r, grp
                   in live_ranges(g).items()
                   if g.entry_device(r) == dev and grp.first <= step <= grp.last)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pools", [True, False])
def test_memory_report_matches_plan_and_brute_force(tmp_path, pools):
    _, g = artifact(tmp_path, pools)
    mem = memory_report(g)
    assert len(mem) == 2
    for dev, m in enumerate(mem):
        assert m.lower_bound == brute_force_peak(g, dev)
        assert m.lower_bound <= m.planned_bytes <= m.no_reuse_bytes
    if pools:
        assert [m.planned_bytes for m in mem] == g.pool_bytes
    assert mem[0].no_reuse_bytes == 5 * align(N * 4)  # x, a, b, copy back, out: one storage each


def test_inspect_writes_pictures_and_summary(tmp_path, capsys):
    path, g = artifact(tmp_path)
    summary, files = inspect_artifacts(path)
    assert summary["kernels_per_device"] == {"cpu:0": 3, "cpu:1": 1}
    assert summary["copies"] == {"cpu:0 -> cpu:1": N * 4, "cpu:1 -> cpu:0": N * 4}
    assert summary["memory"]["cpu:0"]["planned_bytes"] == g.pool_bytes[0]
    dot = open(os.path.join(path, "inspect", "graph.dot")).read()
    assert dot.count("shape=diamond") == 2 and dot.startswith("digraph")
    pngs = [f for f in files if f.endswith(".png")]
    for f in pngs:
        assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", path]) == 0
    assert "planned/bound" in capsys.readouterr().out


def test_cli_run_and_profile(tmp_path, capsys):
    path, _ = artifact(tmp_path)
    x = np.arange(N, dtype="float32")
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "y.npz"
    assert main(["run", path, "--input", f"x={tmp_path / 'x.npy'}", "--save-output", str(out)]) == 0
    np.testing.assert_allclose(np.load(out)["arr_0"], x + (x + 2) * 2)
    trace = tmp_path / "trace.json"
    assert main(["profile", path, "--random-inputs", "--trace", str(trace)]) == 0
    assert "by device:" in capsys.readouterr().out
    assert len([e for e in json.load(open(trace))["traceEvents"] if e["ph"] == "B"]) == 6


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    path, _ = artifact(tmp_path)
    assert main(["run", path]) == 2
    assert "no value for inputs ['x']" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nothing")]) == 2


def test_summary_counts_kernels_by_provider_and_the_isa_their_weights_were_packed_for():
    from hgrt.inspect import format_summary

    summary = {"kernels_per_device": {"cpu:0": 9}, "num_copies": 0, "copies": {},
               "streams": {}, "memory": {},
               "providers": {"onednn avx2": 4, "onednn": 3, "onednn avx512_core": 1}}
    lines = format_summary(summary).splitlines()
    assert "  of which onednn: 8 (4 with weights packed for avx2, 1 with weights packed for " \
           "avx512_core)" in lines
    summary["providers"] = {"onednn": 2}  # weightless kernels only (concat, pool, affine)
    assert "  of which onednn: 2" in format_summary(summary).splitlines()


@pytest.mark.skipif(onednn.unavailable_reason() is not None, reason="oneDNN unavailable")
@pytest.mark.parametrize("winograd", ["all", None])
def test_inspect_says_what_onednn_weights_take_against_plain_ones(tmp_path, capsys, winograd):
    """The bytes of oneDNN's packed weights against the model's own: Winograd's growth said."""
    import onnx

    model = tmp_path / "sq.onnx"
    assert main(["zoo", "squeezenet", "-o", str(model)]) == 0
    plain = sum(np.prod(t.dims) * 4 for t in onnx.load(str(model)).graph.initializer)
    art = tmp_path / "art"
    args = ["compile", str(model), "--device", "cpu", "-o", str(art)]
    assert main(args + (["--winograd", winograd] if winograd else [])) == 0
    capsys.readouterr()
    assert main(["inspect", str(art)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("oneDNN's weig"))
    packed, plain_said = (float(v) for v in re.findall(r"([\d.]+) MiB", line)[:2])
    assert abs(plain_said - plain / 2**20) < 0.1  # every conv of squeezenet is oneDNN's
    growth = float(re.search(r"add ([\d.]+) MiB", line)[1])
    if winograd == "all":
        # squeezenet's eight 3x3s but fire2's and fire3's (16 -> 64: too few channels)
        assert "6 Winograd convolutions" in line and growth > plain / 2**20
    else:  # the default share: at most 10 % of the weights
        assert growth <= 0.1 * plain / 2**20 + 0.05
    assert abs(packed - plain_said - growth) < 0.1 * plain / 2**20
