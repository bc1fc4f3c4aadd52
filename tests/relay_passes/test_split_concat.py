"""split_concat: a convolution of a two-part concat runs as two convolutions and an add, equal
to the Relax VM, and only where the module doc says."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.runtime import onednn
from hgrt.testing import run_hgrt, run_relax_vm

REASON = onednn.unavailable_reason()
KERNELS = ["tvm", pytest.param("onednn", marks=pytest.mark.skipif(
    REASON is not None, reason=f"oneDNN unavailable: {REASON}"))]
TOL = {"rtol": 1e-4, "atol": 1e-4}
CA, CB, OC = 8, 12, 10  # unequal parts: a cut at the wrong channel gives wrong numbers


def fire_onnx(pool=False, parts=2, concat_out=False, second_reader=False, groups=1, seed=0):
    """x -> [1x1 conv, 3x3 conv (, 1x1 conv)] -> Relu each -> Concat(axis 1) -> [MaxPool 3x3/2]
    -> Conv 1x1 (weight ``w``, bias ``b``) -> Relu -> Conv 1x1 -> y; optionally the concat
    also an output, or also read by a Sigmoid (output ``s``)."""
    rng = np.random.default_rng(seed)
    inits: list = []

    def init(name, shape):
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype("float32"), name))
        return name

    widths = [CA, CB, 6][:parts]
    nodes, cat_in = [], []
    for i, c in enumerate(widths):
        k = 3 if i == 1 else 1
        nodes.append(helper.make_node("Conv", ["x", init(f"e{i}", (c, 4, k, k))], [f"c{i}"],
                                      pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        cat_in.append(f"r{i}")
    nodes.append(helper.make_node("Concat", cat_in, ["cat"], axis=1))
    read = "cat"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["cat"], ["pooled"], kernel_shape=[3, 3],
                                      strides=[2, 2]))
        read = "pooled"
    nodes.append(helper.make_node("Conv", [read, init("w", (OC, sum(widths) // groups, 1, 1)),
                                           init("b", (OC,))], ["y0"], group=groups))
    nodes.append(helper.make_node("Relu", ["y0"], ["y1"]))
    nodes.append(helper.make_node("Conv", ["y1", init("t", (4, OC, 1, 1))], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if concat_out:
        outputs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, None))
    if second_reader:
        nodes.append(helper.make_node("Sigmoid", ["cat"], ["s"]))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 4, 11, 11])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build_and_check(model, kernels="tvm", devices=("cpu",), placement=None):
    """Build, compare with the Relax VM; the build result."""
    x = np.random.default_rng(1).standard_normal((1, 4, 11, 11)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, list(devices), placement, kernels=kernels)
        want = run_relax_vm(model, [x])
    got = run_hgrt(res, {"x": x})
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)
    return res


def _concats(res) -> list[str]:
    return [n.name for n in res.graph.nodes if n.op != "null"
            and "concat" in n.attrs.get("func_name", "") + n.attrs.get("onednn_op", "")]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("pool", [False, True], ids=["conv", "pool-conv"])
def test_a_convolution_of_a_concat_runs_on_its_parts(kernels, pool):
    res = _build_and_check(fire_onnx(pool=pool), kernels)
    assert _concats(res) == []
    # the weight's halves replace it: output channels kept, input channels cut at CA (with
    # oneDNN, each half packed into a blob of its name)
    assert "w" not in res.params and {"w.split0", "w.split1"} <= set(res.params)
    if kernels == "tvm":
        whole = numpy_helper.to_array(next(i for i in fire_onnx().graph.initializer
                                           if i.name == "w"))
        np.testing.assert_array_equal(res.params["w.split0"], whole[:, :CA])
        np.testing.assert_array_equal(res.params["w.split1"], whole[:, CA:])
    split_rows = [r for r in res.placement_report if "split_concat" in r.reason]
    assert len(split_rows) == (4 if pool else 2)  # two convolutions (and two pools)
    if kernels == "onednn":
        # part 0's kernel adds part 1's result as a residual, in place where it dies
        (summed,) = [n for n in res.graph.nodes if "+add" in n.attrs.get("onednn_op", "")]
        assert summed.attrs["onednn_op"] == "conv2d+add+bias+relu"
        assert summed.attrs.get("inplace") == "2"


@pytest.mark.parametrize("case", [
    {"parts": 3}, {"concat_out": True}, {"second_reader": True}, {"groups": 2}])
def test_not_split_where_the_concat_is_needed_or_the_sum_would_not_hold(case):
    """Three parts (two more calls), a concat that is an output or read by another op (it is
    written anyway), a grouped convolution (not a sum over all input channels)."""
    res = _build_and_check(fire_onnx(**case))
    assert _concats(res) and not any(".split" in name for name in res.params)


def test_not_split_across_devices():
    """The concat on cpu:0, its convolution on cpu:1: the concat is one copy between them."""
    placement = hgrt.Placement(rules={"nn.conv2d": "cpu:1", "concat": "cpu:0"})
    res = _build_and_check(fire_onnx(), devices=("cpu:0", "cpu:1"), placement=placement)
    assert _concats(res) and not any(".split" in name for name in res.params)
