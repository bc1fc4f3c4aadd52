"""Why each kernel runs where it does and by whom: the reasons a build records (the graph's
``device_why`` / ``provider_why`` attrs, the placement report's ``kernels_why``) under
kernels="auto", "tvm", "onednn" and on [cpu, cuda] (build level: no GPU needed), and what
``hgrt inspect --ops`` and ``summary`` make of them, also for a graph without them."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.cli import main
from hgrt.graph import Graph
from hgrt.graph_format import DEVICE_WHY, PROVIDER_WHY
from hgrt.inspect import NOT_RECORDED, format_ops, op_rows, reason_kind, summary
from hgrt.providers.cudalibs import kernels as cudalibs
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import GraphBuilder, matmul_module

needs_onednn = pytest.mark.skipif(onednn.unavailable_reason() is not None,
                                  reason=f"oneDNN unavailable: {onednn.unavailable_reason()}")


def convs(layers: list[tuple[int, int, int, list[int]]], c: int = 8, hw: int = 9, seed: int = 0):
    """x (1, c, hw, hw) → per layer (out channels, kernel, groups, pads) Conv → Relu, an ONNX
    model (opset 13)."""
    rng = np.random.default_rng(seed)
    nodes, inits, src = [], [], "x"
    for i, (oc, k, groups, pads) in enumerate(layers):
        w = rng.standard_normal((oc, c // groups, k, k)).astype("float32")
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [src, f"w{i}"], [f"c{i}"], pads=pads, group=groups),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        src, c = f"r{i}", oc
    graph = helper.make_graph(
        nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, hw, hw])],
        [helper.make_tensor_value_info(src, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


SMALL = [(16, 3, 1, [1, 1, 1, 1])]  # 8 -> 16 3x3 on 9x9: 93k multiply-adds
LARGE = [(32, 3, 1, [1, 1, 1, 1])]  # 8 -> 32 3x3 on 32x32: 2.4M


def kernels_of(res) -> list[dict[str, str]]:
    return op_rows(res.graph)


def conv_row(res) -> dict[str, str]:
    (row,) = [r for r in kernels_of(res) if "conv2d" in r["op"]]
    return row


# ---- CPU: oneDNN or TVM --------------------------------------------------------------------

@needs_onednn
def test_auto_leaves_a_small_model_below_onednn_s_size_floor_and_takes_a_large_one():
    small = conv_row(hgrt.build(convs(SMALL), ["cpu"], kernels="auto"))
    assert small["provider"] == "tvm" and reason_kind(small["provider_why"]) == "size floor"
    assert "93k MACs < 2.1M (auto)" in small["provider_why"]
    large = hgrt.build(convs(LARGE, hw=32), ["cpu"], kernels="auto")
    row = conv_row(large)
    assert row["provider"] == "onednn"
    assert row["provider_why"].startswith("auto: conv2d+relu 3x3 8->32, 2.4M MACs")
    assert row["device"] == "cpu:0" and row["device_why"] == "fallback"
    # the placement report says it per op, the ReLU that the kernel took included
    assert {(r.op, r.kernels, r.kernels_why) for r in large.placement_report} == {
        (op, "onednn", row["provider_why"]) for op in ("relax.nn.conv2d", "relax.nn.relu")}


@needs_onednn
@pytest.mark.parametrize("kernels, provider, why", [
    ("tvm", "tvm", "asked: kernels='tvm'"),
    ("onednn", "onednn", "asked: kernels='onednn'; conv2d+relu 3x3 8->16, 93k MACs"),
    (hgrt.Kernels("onednn", rules={"nn.conv2d": "tvm"}), "tvm",
     "asked: kernels rule 'nn.conv2d'='tvm'")])
def test_a_provider_asked_for_says_where(kernels, provider, why):
    row = conv_row(hgrt.build(convs(SMALL), ["cpu"], kernels=kernels))
    assert (row["provider"], row["provider_why"]) == (provider, why)


def _two_input_matmul():
    """a (8,) @ b (8, 16), both inputs: no constant weight for oneDNN's dense kernel, and a
    vector (oneDNN's matmul of two activations takes rank 2 or more)."""
    return matmul_module((8,), (8, 16))


@needs_onednn
def test_what_onednn_cannot_compute_or_run_says_so(monkeypatch):
    (row,) = kernels_of(hgrt.build(_two_input_matmul(), ["cpu"], kernels="auto"))
    assert row["provider"] == "tvm" and row["provider_why"].startswith(
        "oneDNN cannot: oneDNN kernels take float32 NCHW convolutions and matmuls")
    monkeypatch.setattr(onednn, "unavailable_reason", lambda: "not installed here")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = conv_row(hgrt.build(convs(LARGE, hw=32), ["cpu"], kernels="auto"))
    assert (row["provider"], row["provider_why"]) == (
        "tvm", "oneDNN unavailable: not installed here")


# ---- CPU + CUDA, built without a GPU -------------------------------------------------------

def _topk_model():
    """x (2, 16) → exp → topk → exp: an op no CUDA kernel of hgrt's computes, between two."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.TupleGetItem(relax.op.topk(bb.emit(relax.op.exp(x)), 4), 0))
            out = bb.emit_output(relax.op.exp(y))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    return mod


def _cuda_build(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, ["cpu:0", "cuda:0"], hgrt.Placement(preferred="cuda:0"),
                          cuda_arch="sm_90", **kw)


def test_topk_goes_to_the_cpu_and_says_why():
    rows = kernels_of(_cuda_build(_topk_model(), kernels="tvm"))
    topk = [r for r in rows if "topk" in r["op"]]
    assert topk and all(r["device"] == "cpu:0" for r in topk)
    assert topk[0]["device_why"].startswith("fallback (cuda:0: TVM's GPU sort")
    assert reason_kind(topk[0]["device_why"]) == "fallback: cuda:0 cannot compile it"
    assert {r["device"]: r["device_why"] for r in rows if "exp" in r["op"]} == {
        "cuda:0": "preferred"}


def test_cuda_convolutions_say_whether_cudnn_pays():
    """Two 1x1 convolutions (TVM's, each fused with its ReLU, the second reading the first's
    kernel), a depthwise one (cuDNN's) and one with asymmetric padding (TVM's: cuDNN cannot)."""
    model = convs([(16, 1, 1, [0, 0, 0, 0]), (16, 1, 1, [0, 0, 0, 0]),
                   (16, 3, 16, [1, 1, 1, 1]), (16, 3, 1, [0, 0, 1, 1])], hw=8)
    res = _cuda_build(model, kernels="auto")
    rows = [r for r in kernels_of(res) if r["device"] == "cuda:0"]
    got = [(r["provider"], r["provider_why"]) for r in rows]
    unusable = cudalibs.unavailable_reason()
    if unusable is not None:  # the cuda extra missing: "auto" takes none of them
        assert got[2] == ("tvm", f"cuBLAS/cuDNN unavailable: {unusable}")
    else:
        assert got[2] == ("cudalibs", "pays: depthwise convolution 3x3 (cuDNN pays for "
                                      "grouped ones)")
    assert got[:2] == [("tvm", "TVM faster: 1x1 convolution 8->16 (auto)"),
                       ("tvm", "TVM faster: 1x1 convolution 16->16 (auto)")]
    assert got[3] == ("tvm", "cuBLAS/cuDNN cannot: asymmetric padding [0, 0, 1, 1]")
    assert len(rows) == 4 and all(r["device_why"] == "preferred" for r in rows)


# ---- hgrt inspect --ops, summary, old graphs -----------------------------------------------

@needs_onednn
def test_inspect_ops_prints_each_kernel_and_summary_counts_the_reasons(tmp_path, capsys):
    res = hgrt.build(convs(SMALL), ["cpu"], kernels="auto")
    path = str(tmp_path / "art")
    hgrt.save(path, res)
    assert main(["inspect", path, "--ops"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("node "))
    assert header.split() == ["node", "op", "device", "provider", "why"]
    assert "tvm: size floor: the model's 1 ops oneDNN could take are 93k MACs" in out
    assert "kernels by why of their provider:" in out
    assert summary(res.graph)["reasons"] == {"provider": {"tvm: size floor": 1},
                                             "device": {"cpu:0: fallback": 1}}


def test_a_graph_without_reasons_still_loads_and_inspects():
    g = GraphBuilder()
    x = g.input("x", dev=0, sid=0)
    g.output(g.op("add_one", [g.op("add_one", [x], dev=0, sids=[1])], dev=0, sids=[2]))
    graph = Graph.from_json(json.dumps(g.doc(pools=True)))
    rows = op_rows(graph)
    assert [(r["provider"], r["provider_why"], r["device_why"]) for r in rows] == \
        [("tvm", NOT_RECORDED, NOT_RECORDED)] * 2
    assert "tvm: not recorded; device 0: not recorded" in format_ops(rows)
    assert summary(graph)["reasons"]["provider"] == {"tvm: not recorded": 2}


def test_a_built_graph_stripped_of_its_reasons_reads_as_not_recorded():
    res = hgrt.build(convs(SMALL), ["cpu"], kernels="tvm")
    doc = json.loads(res.graph_json)
    kernels = [n for n in doc["nodes"] if n["op"] == "tvm_op"]
    assert kernels and all(PROVIDER_WHY in n["attrs"] and DEVICE_WHY in n["attrs"]
                           for n in kernels)
    for n in kernels:
        del n["attrs"][PROVIDER_WHY], n["attrs"][DEVICE_WHY]
    rows = op_rows(Graph.from_json(json.dumps(doc)))
    assert {(r["provider_why"], r["device_why"]) for r in rows} == {(NOT_RECORDED,) * 2}


def test_reason_kinds():
    assert reason_kind("auto: 0.006 ms on cuda:0 vs 0.048 ms on cpu:0") == "auto"
    assert reason_kind("rule 'nn.conv2d'") == "rule 'nn.conv2d'"
    assert reason_kind("fallback; split over the parts of lv30 (split_concat)") == "fallback"
    assert reason_kind("fallback (cuda:0: data-dependent output shape)") == \
        "fallback: cuda:0 cannot compile it"
