"""split_concat: a convolution of a two-part concat runs as two convolutions and an add, equal
to the Relax VM, and only where the module doc says."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import build_and_compare

REASON = onednn.unavailable_reason()
KERNELS = ["tvm", pytest.param("onednn", marks=pytest.mark.skipif(
    REASON is not None, reason=f"oneDNN unavailable: {REASON}"))]
TOL = {"rtol": 1e-4, "atol": 1e-4}
CA, CB, OC = 8, 12, 10  # unequal parts: a cut at the wrong channel gives wrong numbers


def fire_onnx(pool=False, parts=2, concat_out=False, second_reader=False, groups=1, axis=1,
              bn=False, shared_weight=False, seed=0, oc=OC):
    """x -> [1x1 conv, 3x3 conv (, 1x1 conv)] -> Relu each -> Concat(axis) -> [MaxPool 3x3/2]
    -> Conv 1x1 (weight ``w``, bias ``b``) [-> BatchNormalization] -> Relu -> Conv 1x1 -> y;
    optionally the concat also an output, or also read by a Sigmoid (output ``s``), or ``w``
    also read by a convolution of a second input ``x2`` (output ``z``)."""
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
    nodes.append(helper.make_node("Concat", cat_in, ["cat"], axis=axis))
    read = "cat"
    if pool:
        nodes.append(helper.make_node("MaxPool", ["cat"], ["pooled"], kernel_shape=[3, 3],
                                      strides=[2, 2]))
        read = "pooled"
    nodes.append(helper.make_node("Conv", [read, init("w", (oc, sum(widths) // groups, 1, 1)),
                                           init("b", (oc,))], ["y0"], group=groups))
    if bn:
        stats = [init(n, (oc,)) for n in ("g", "beta", "m")]
        inits.append(numpy_helper.from_array(np.full(oc, 2.0, "float32"), "v"))
        nodes.append(helper.make_node("BatchNormalization", ["y0", *stats, "v"], ["y0n"]))
    nodes.append(helper.make_node("Relu", ["y0n" if bn else "y0"], ["y1"]))
    nodes.append(helper.make_node("Conv", ["y1", init("t", (4, oc, 1, 1))], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if concat_out:
        outputs.append(helper.make_tensor_value_info("cat", TensorProto.FLOAT, None))
    if second_reader:
        nodes.append(helper.make_node("Sigmoid", ["cat"], ["s"]))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 11, 11])]
    if shared_weight:
        inputs.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT,
                                                    [1, sum(widths), 5, 5]))
        nodes.append(helper.make_node("Conv", ["x2", "w"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "fire", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build_and_check(model, kernels="tvm", devices=("cpu",), placement=None):
    """Build, compare with the Relax VM; the build result."""
    return build_and_compare(model, devices, placement, kernels, **TOL)


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
    # two convolutions (and two pools), and the sum that took the convolution's variable
    assert sorted(r.op for r in split_rows) == sorted(
        ["relax.nn.conv2d"] * 2 + ["relax.nn.max_pool2d"] * 2 * pool + ["relax.add"])
    assert not any(r.op == "relax.concat" for r in res.placement_report)
    if kernels == "onednn":
        # part 0's kernel adds part 1's result as a residual, in place where it dies
        (summed,) = [n for n in res.graph.nodes if "+add" in n.attrs.get("onednn_op", "")]
        assert summed.attrs["onednn_op"] == "conv2d+add+bias+relu"
        assert summed.attrs.get("inplace") == "2"


def test_a_negative_axis_and_a_weight_read_elsewhere():
    """``axis=-3`` is the channel axis of NCHW; ``w`` also read by an unsplit convolution stays
    a weight beside its halves."""
    res = _build_and_check(fire_onnx(axis=-3, shared_weight=True))
    assert _concats(res) == []
    assert {"w", "w.split0", "w.split1"} <= set(res.params)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", [
    {"parts": 3}, {"concat_out": True}, {"second_reader": True}, {"groups": 2}, {"bn": True},
    {"oc": 2 * (CA + CB)}])
def test_not_split_where_the_concat_is_needed_or_the_sum_would_not_hold(case, kernels):
    """Three parts (two more calls), a concat that is an output or read by another op (it is
    written anyway), a grouped convolution (not a sum over all input channels), a batch norm
    after the convolution (oneDNN folds it into one convolution's weights, not a sum's), a
    convolution whose result is larger than the concat (its partial sum would cost more than
    the concat's copy)."""
    res = _build_and_check(fire_onnx(**case), kernels)
    assert _concats(res) and not any(".split" in name for name in res.params)


def test_not_split_across_devices():
    """The concat on cpu:0, its convolution on cpu:1: the concat is one copy between them."""
    placement = hgrt.Placement(rules={"nn.conv2d": "cpu:1", "concat": "cpu:0"})
    res = _build_and_check(fire_onnx(), devices=("cpu:0", "cpu:1"), placement=placement)
    assert _concats(res) and not any(".split" in name for name in res.params)
