"""claim_onednn: which ops oneDNN kernels take, and that the builds equal onnxruntime."""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.providers.onednn import claim_onednn as claim
from hgrt.providers.onednn import kernels as onednn
from hgrt.providers.onednn import policy as onednn_policy
from hgrt.providers.onednn.blob import (
    HEADER_INT64,
    HEADER_VERSION,
    HEADER_VERSION_ELTWISE,
    SLOT,
    make_header,
)
from hgrt.relay_passes.util.kernels import WINOGRAD_SHARE, Kernels
from hgrt.testing import (
    alternating,
    assert_close_to,
    build_and_compare,
    onnx_inputs,
    reference,
    run_hgrt,
    zoo_input,
    zoo_model,
)

REASON = onednn.unavailable_reason()
needs_onednn = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
TOL = {"rtol": 1e-4, "atol": 1e-4}
WINOGRAD_ALL = Kernels("onednn", winograd=True)  # every 3x3 where it is faster


def conv_onnx(c=8, oc=16, hw=9, k=3, stride=1, pad=(1, 1, 1, 1), dilation=1, groups=1,
              bias=True, bn=False, residual=False, relu=True, seed=0):
    """x → Conv [→ BatchNormalization] [→ Add(r)] [→ Relu] as an ONNX model (opset 13);
    a second input ``r`` when ``residual``."""
    rng = np.random.default_rng(seed)
    oh = (hw + pad[0] + pad[2] - dilation * (k - 1) - 1) // stride + 1
    ow = (hw + pad[1] + pad[3] - dilation * (k - 1) - 1) // stride + 1

    def init(name, shape, positive=False):
        v = rng.standard_normal(shape).astype("float32")
        inits.append(numpy_helper.from_array(np.abs(v) + 0.5 if positive else v, name))
        return name

    inits: list = []
    conv_in = ["x", init("w", (oc, c // groups, k, k))] + ([init("b", (oc,))] if bias else [])
    nodes = [helper.make_node("Conv", conv_in, ["y0"], strides=[stride] * 2, pads=list(pad),
                              dilations=[dilation] * 2, group=groups)]
    if bn:
        names = [init("g", (oc,)), init("beta", (oc,)), init("m", (oc,)),
                 init("v", (oc,), positive=True)]
        nodes.append(helper.make_node("BatchNormalization", ["y0", *names], ["y1"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, oc, oh, ow]))
        nodes.append(helper.make_node("Add", [nodes[-1].output[0], "r"], ["y2"]))
    if relu:
        nodes.append(helper.make_node("Relu", [nodes[-1].output[0]], ["y3"]))
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(nodes, "conv", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _check(model, devices=("cpu",), placement=None, kernels="onednn"):
    """Build with oneDNN, compare with onnxruntime; the build result."""
    return build_and_compare(model, devices, placement, kernels, **TOL)


def _onednn_nodes(res):
    """The claimed convolutions and dense layers (not concats, pools, reorders)."""
    return [n for n in res.graph.nodes if n.func_name in claim.FUNC_NAME.values()]


CASES = {
    "3x3": {},
    "7x7 stride 2, pad 3": dict(c=3, oc=16, hw=23, k=7, stride=2, pad=(3, 3, 3, 3)),
    "asymmetric pads": dict(pad=(0, 1, 2, 1)),
    "dilation 2": dict(dilation=2, pad=(2, 2, 2, 2)),
    "groups 2": dict(groups=2),
    "depthwise": dict(c=16, groups=16),
    "1x1, no bias, no relu": dict(k=1, pad=(0, 0, 0, 0), bias=False, relu=False),
    "residual add + relu": dict(residual=True),
    "batch norm + residual": dict(bias=False, bn=True, residual=True),
}


@needs_onednn
@pytest.mark.parametrize("case", list(CASES))
def test_conv_chains_equal_the_relax_vm(case):
    res = _check(conv_onnx(**CASES[case]))
    (node,) = _onednn_nodes(res)  # the whole chain is one kernel
    assert node.func_name == "hgrt.onednn.conv2d"
    assert node.attrs["onednn_isa"] == onednn.isa()
    kw = CASES[case]
    want = ["conv2d", *(["bias"] if kw.get("bias", True) else []),
            *(["batch_norm"] if kw.get("bn") else []), *(["add"] if kw.get("residual") else []),
            *(["relu"] if kw.get("relu", True) else [])]
    assert node.attrs["onednn_op"] == "+".join(want)
    assert sum(n.op == "tvm_op" for n in res.graph.nodes) == 1


def _conv3x3_model(name: str, steps: list[tuple[str, list[str], str]]):
    """x (1, 8, 12, 12) through ``steps`` (op, inputs, output), the last output ``y``; each Conv
    is 3x3, padded, 16 output channels, with the next weight ``w<i>``."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for op, ins, out in steps:
        if op == "Conv":
            c = 8 if not inits else 16
            w = f"w{len(inits)}"
            inits.append(numpy_helper.from_array(
                (rng.standard_normal((16, c, 3, 3)) / np.sqrt(9 * c)).astype("float32"), w))
            nodes.append(helper.make_node("Conv", [*ins, w], [out], pads=[1, 1, 1, 1]))
        else:
            nodes.append(helper.make_node(op, ins, [out]))
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 12, 12])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _block_onnx():
    """x → conv+relu = a → conv(a)+a → relu → conv → y: ``a`` is read by two oneDNN kernels
    (as input and as residual), the second result by the third conv only."""
    return _conv3x3_model("block", [("Conv", ["x"], "c0"), ("Relu", ["c0"], "a"),
                                    ("Conv", ["a"], "c1"), ("Add", ["c1", "a"], "s"),
                                    ("Relu", ["s"], "b"), ("Conv", ["b"], "y")])


@needs_onednn
def test_results_between_onednn_kernels_stay_nhwc():
    res = _check(_block_onnx())
    first, second, third = _onednn_nodes(res)
    assert first.attrs["onednn_layouts"] == "plain, acdb"  # the model's input: NCHW
    # the second kernel reads ``a`` as input and residual in the layout the first one wrote
    assert second.attrs["onednn_op"] == "conv2d+add+relu"
    assert second.attrs["onednn_layouts"] == "acdb, acdb, acdb"
    assert third.attrs["onednn_layouts"] == "acdb, plain"  # the model's output: NCHW
    g = res.graph
    assert g.shapes[g.entry_id(g.nodes.index(first))] == (1, 12, 12, 16)  # N, H, W, C
    assert len(_onednn_nodes(res)) == sum(n.op == "tvm_op" for n in g.nodes)  # no reorder node


def _bottleneck_onnx():
    """x → conv+relu = a → conv+relu = b → conv(b) + a → relu → conv → y: the residual ``a``
    is read last by the add, so the add's result may take its bytes."""
    return _conv3x3_model("bottleneck", [
        ("Conv", ["x"], "c0"), ("Relu", ["c0"], "a"), ("Conv", ["a"], "c1"),
        ("Relu", ["c1"], "b"), ("Conv", ["b"], "c2"), ("Add", ["c2", "a"], "s"),
        ("Relu", ["s"], "r"), ("Conv", ["r"], "y")])


@needs_onednn
def test_a_residual_add_writes_over_its_residual_where_it_dies():
    """The kernel adding the residual offers its output the residual's bytes; the plan takes
    them when the residual dies there (here, not in ``_block_onnx``, whose kernel reads it as
    its input too), and the kernel then adds with a sum post-op into them: the same numbers
    as the Relax VM and as the plan without the offer, in fewer pool bytes."""
    import dataclasses

    from hgrt.graph import Graph
    from hgrt.relay_passes.graph.plan_memory import plan_memory

    res = _check(_bottleneck_onnx())
    g = res.graph
    add = next(n for n in _onednn_nodes(res) if "add" in n.attrs["onednn_op"])
    nid = g.nodes.index(add)
    residual = g.entry_id(*add.inputs[int(add.attrs["inplace"])][:2])
    assert add.attrs["inplace"] == "2"
    assert g.storage_ids[residual] == g.storage_ids[g.entry_id(nid)]
    other = _check(_block_onnx()).graph  # the offer stands but is not taken
    (second,) = [n for n in other.nodes if n.attrs.get("inplace")]
    sid = other.storage_ids
    assert sid[other.entry_id(*second.inputs[2][:2])] != sid[other.entry_id(
        other.nodes.index(second))]

    plain = Graph.from_json(res.graph_json)  # the same graph, planned without the offer
    for n in plain.nodes:
        n.attrs.pop("inplace", None)
    plain = plan_memory(dataclasses.replace(plain, storage_ids=list(range(plain.num_entries))))
    assert g.pool_bytes[0] < plain.pool_bytes[0]
    inputs = onnx_inputs(_bottleneck_onnx())
    with_offer = run_hgrt(res, inputs)
    without = run_hgrt(dataclasses.replace(res, graph_json=plain.to_json(), graph=plain), inputs)
    np.testing.assert_allclose(with_offer[0], without[0], rtol=1e-6, atol=1e-6)


def _stem_onnx(ceil_mode: int):
    """A model's stem: x → conv+relu → max pool → conv → max pool → y. The first pool follows
    a convolution of the model's input (absorbed into its kernel), the second one does not."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((16, c, 3, 3)).astype("float32"),
                                     f"w{i}") for i, c in enumerate((3, 16))]
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": ceil_mode}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], strides=[2, 2]),
             helper.make_node("Relu", ["c0"], ["a"]),
             helper.make_node("MaxPool", ["a"], ["p"], **pool),
             helper.make_node("Conv", ["p", "w1"], ["c1"], pads=[1] * 4),
             helper.make_node("MaxPool", ["c1"], ["y"], **pool)]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, 33, 33])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@needs_onednn
@pytest.mark.parametrize("ceil_mode", [0, 1])
def test_a_max_pool_after_a_convolution_of_the_input_runs_in_its_kernel(ceil_mode):
    res = _check(_stem_onnx(ceil_mode))
    g = res.graph
    first, second = _onednn_nodes(res)
    assert first.attrs["onednn_op"] == "conv2d+relu+max_pool"
    assert first.attrs["onednn_layouts"] == "plain, acdb"
    # conv: 33 -> 16; pool: 16 -> 7, or 8 with ceil mode (a window past the end: the bottom
    # and right pads grown); N, H, W, C between the kernels
    side = 7 + ceil_mode
    assert g.shapes[g.entry_id(g.nodes.index(first))] == (1, side, side, 16)
    assert second.attrs["onednn_op"] == "conv2d"  # its pool: a kernel of its own
    assert len(_by_func(res, "pool")) == 1


def _by_func(res, name):
    return [n for n in res.graph.nodes if n.func_name == f"hgrt.onednn.{name}"]


@needs_onednn
@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 3, 5]), st.integers(1, 2),
       st.integers(0, 2), st.integers(1, 2), st.booleans())
def test_random_convolutions_equal_the_relax_vm(cpg, groups, k, stride, pad, dilation, relu):
    _check(conv_onnx(c=4 * cpg * groups // groups * groups, oc=8 * groups, hw=11, k=k,
                     stride=stride, pad=(pad,) * 4, dilation=dilation, groups=groups,
                     relu=relu, seed=k + stride))


def _dense_onnx(gemm: bool):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((10, 32) if gemm else (32, 10)).astype("float32")
    b = rng.standard_normal(10).astype("float32")
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = ([helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1)] if gemm else
             [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"],
                                                                             ["g"])])
    nodes.append(helper.make_node("Relu", ["g"], ["y"]))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 32])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@needs_onednn
@pytest.mark.parametrize("gemm", [False, True])
def test_dense_with_bias_and_relu_equals_the_relax_vm(gemm):
    (node,) = _onednn_nodes(_check(_dense_onnx(gemm)))
    assert (node.func_name, node.attrs["onednn_op"]) == ("hgrt.onednn.dense", "dense+bias+relu")


def _batched_dense_onnx(shape=(2, 5, 32), scale_last=True):
    """A transformer's linear layer: an N-D activation times a constant weight, a bias, a
    per-channel scale, a residual add and a relu."""
    rng = np.random.default_rng(3)
    k, n = shape[-1], 24
    inits = [numpy_helper.from_array(rng.standard_normal((k, n)).astype("float32") / 4, "w"),
             numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b"),
             numpy_helper.from_array(rng.uniform(0.5, 2, n if scale_last else (shape[-2], 1))
                                     .astype("float32"), "s")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]), helper.make_node("Mul", ["a", "s"], ["c"]),
             helper.make_node("Add", ["c", "r"], ["d"]), helper.make_node("Relu", ["d"], ["y"])]
    out = [*shape[:-1], n]
    graph = helper.make_graph(nodes, "batched_dense", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
        helper.make_tensor_value_info("r", TensorProto.FLOAT, out)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@needs_onednn
@pytest.mark.parametrize("shape", [(2, 5, 32), (1, 3, 4, 32)], ids=["3-D", "4-D"])
def test_a_matmul_of_any_rank_by_a_constant_weight_is_one_dense_kernel(shape):
    model = _batched_dense_onnx(shape)
    (node,) = _onednn_nodes(_check(model))
    assert node.attrs["onednn_op"] == "dense+bias+scale+add+relu"
    placement = hgrt.Placement(rules={"matmul": "cpu:1"}, fallback="cpu:0")
    assert len(_onednn_nodes(_check(model, ("cpu:0", "cpu:1"), placement))) == 1


@needs_onednn
def test_a_scale_along_another_axis_than_a_dense_layer_s_channels_stays_apart():
    (node,) = _onednn_nodes(_check(_batched_dense_onnx(scale_last=False)))
    assert node.attrs["onednn_op"] == "dense+bias"


def _activation_onnx(root: str, act: str, opset: int = 20):
    """A convolution or an N-D dense layer with a bias, then an activation as exporters write
    it: ``silu`` as x * sigmoid(x), ``gelu`` / ``gelu_tanh`` as ONNX Gelu, else the op."""
    rng = np.random.default_rng(5)
    if root == "conv":
        shape, out = [1, 8, 10, 10], [1, 16, 10, 10]
        inits = [numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype("float32")
                                         / 6, "w"),
                 numpy_helper.from_array(rng.standard_normal(16).astype("float32"), "b")]
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["a"], pads=[1, 1, 1, 1])]
    else:
        shape, out = [2, 6, 32], [2, 6, 24]
        inits = [numpy_helper.from_array(rng.standard_normal((32, 24)).astype("float32") / 4,
                                         "w"),
                 numpy_helper.from_array(rng.standard_normal(24).astype("float32"), "b")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
                 helper.make_node("Add", ["m", "b"], ["a"])]
    if act == "silu":
        nodes += [helper.make_node("Sigmoid", ["a"], ["s"]),
                  helper.make_node("Mul", ["a", "s"], ["y"])]
    elif act.startswith("gelu"):
        nodes.append(helper.make_node("Gelu", ["a"], ["y"],
                                      approximate="tanh" if act == "gelu_tanh" else "none"))
    else:
        nodes.append(helper.make_node(act.capitalize(), ["a"], ["y"]))
    graph = helper.make_graph(nodes, "act", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape)], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@needs_onednn
@pytest.mark.parametrize("root", ["conv", "dense"])
@pytest.mark.parametrize(("act", "post"), [("silu", "swish"), ("gelu", "gelu_erf"),
                                           ("gelu_tanh", "gelu_tanh"), ("sigmoid", "sigmoid"),
                                           ("tanh", "tanh")])
def test_silu_gelu_sigmoid_and_tanh_are_post_ops(root, act, post):
    model = _activation_onnx(root, act)
    (node,) = _onednn_nodes(_check(model))
    kind = "conv2d" if root == "conv" else "dense"
    assert node.attrs["onednn_op"] == f"{kind}+bias+{post}"
    placement = hgrt.Placement(rules={"nn.conv2d": "cpu:1", "matmul": "cpu:1"}, fallback="cpu:0")
    assert len(_onednn_nodes(_check(model, ("cpu:0", "cpu:1"), placement))) == 1


@needs_onednn
@pytest.mark.parametrize("last_axis_kept", [True, False])
def test_a_dense_layer_s_chain_goes_on_through_a_reshape_of_its_rows(last_axis_kept):
    """``x.view(-1, n) @ W + b``, viewed back to (batch, seq, n) before its GELU and a residual
    add (a torch export's linear layers): one kernel, the GELU and the add its post-ops; a
    reshape that moves the last axis ends the chain (the GELU a TVM kernel)."""
    rng = np.random.default_rng(5)
    back = [2, 6, 24] if last_axis_kept else [2, 12, 12]
    inits = [numpy_helper.from_array(rng.standard_normal((32, 24)).astype("float32") / 4, "w"),
             numpy_helper.from_array(rng.standard_normal(24).astype("float32"), "b"),
             numpy_helper.from_array(np.array([12, 32], "int64"), "rows"),
             numpy_helper.from_array(np.array(back, "int64"), "back")]
    nodes = [helper.make_node("Reshape", ["x", "rows"], ["x2"]),
             helper.make_node("MatMul", ["x2", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Reshape", ["a", "back"], ["v"]),
             helper.make_node("Gelu", ["v"], ["g"], approximate="tanh"),
             helper.make_node("Add", ["g", "r"], ["y"])]
    graph = helper.make_graph(nodes, "view", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 32]),
        helper.make_tensor_value_info("r", TensorProto.FLOAT, back)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, back)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    res = _check(model)
    (node,) = _onednn_nodes(res)
    assert node.attrs["onednn_op"] == ("dense+bias+gelu_tanh+add" if last_axis_kept
                                       else "dense+bias")
    others = [n for n in res.graph.nodes if n.op != "null" and n not in _onednn_nodes(res)
              and n.attrs.get("func_name") != "__nop"]  # (the views: no kernel)
    assert bool(others) != last_axis_kept, [n.name for n in others]


@needs_onednn
def test_a_last_swish_is_hgrt_s_pass_after_the_primitive_ragged_tail_and_all():
    """Swish as the last post-op runs as hgrt's own pass over the kernel's result (node attr
    ``onednn_impl`` ends ``+hgrt_swish`` where the CPU has AVX2 or AVX-512): 3 x 37 outputs
    (a tail after the whole vectors), inputs up to +-60 (exp's clamps), onnxruntime's numbers."""
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.standard_normal((40, 37)).astype("float32") * 2, "w"),
             numpy_helper.from_array(rng.standard_normal(37).astype("float32"), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["s"]), helper.make_node("Mul", ["a", "s"], ["y"])]
    graph = helper.make_graph(nodes, "swish", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [3, 40])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [3, 37])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    res = _check(model)
    (node,) = _onednn_nodes(res)
    assert node.attrs["onednn_op"] == "dense+bias+swish"
    assert node.attrs["onednn_impl"].endswith("+hgrt_swish") == onednn.isa().startswith(
        ("avx2", "avx512"))
    x = {"x": rng.uniform(-4, 4, (3, 40)).astype("float32")}
    got, want = run_hgrt(res, x)[0], reference(model, x)[0]
    assert np.abs(want).max() > 50 and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_onednn
def test_a_blob_with_an_eltwise_post_op_carries_its_own_version():
    res = _check(_activation_onnx("dense", "gelu"))
    (blob,) = [v for k, v in res.params.items() if v.dtype == np.uint8]
    header = blob[:HEADER_INT64 * 8].view(np.int64)
    assert header[SLOT["version"]] == HEADER_VERSION_ELTWISE != HEADER_VERSION
    plain = _check(_dense_onnx(gemm=False))
    (blob,) = [v for k, v in plain.params.items() if v.dtype == np.uint8]
    assert blob[:HEADER_INT64 * 8].view(np.int64)[SLOT["version"]] == HEADER_VERSION


@needs_onednn
def test_clip_is_a_post_op():
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    w = relax.Var("w", relax.TensorType((8, 4, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, w, padding=(1, 1)))
            out = bb.emit_output(bb.emit(relax.op.clip(c, 0.0, 6.0)))
        bb.emit_func_output(out)
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 4, 3, 3)).astype("float32")}
    xv = rng.standard_normal((1, 4, 6, 6)).astype("float32")
    res = hgrt.build(bb.finalize(), ["cpu"], params=params, kernels="onednn")
    (node,) = _onednn_nodes(res)
    assert node.attrs["onednn_op"] == "conv2d+clip"
    want = reference(bb.finalize(), [xv], params)[0]
    np.testing.assert_allclose(run_hgrt(res, {"x": xv})[0], want, **TOL)


@needs_onednn
def test_report_and_graph_say_who_computes_each_op():
    res = _check(conv_onnx(residual=True))
    table = res.print_placement()
    assert table.splitlines()[0].split()[:4] == ["node", "op", "device", "kernels"]
    assert {r.kernels for r in res.placement_report} == {"onednn"}
    graph = json.loads(res.graph_json)
    (node,) = [n for n in graph["nodes"] if n.get("attrs", {}).get("provider") == "onednn"]
    assert node["attrs"]["num_inputs"] == "3"  # x, the packed weights, the residual
    # the packed weights took the conv weight's name; bias and kernel are gone from the params
    assert sorted(res.params) == ["w"] and res.params["w"].dtype == np.uint8


@needs_onednn
def test_squeezenet_split_over_two_devices_equals_the_reference():
    model = zoo_model("squeezenet")
    res = _check(model, ["cpu:0", "cpu:1"], alternating(model))
    devices = {res.graph.entry_device(res.graph.entry_id(res.graph.nodes.index(n)))
               for n in _onednn_nodes(res)}
    assert len(_onednn_nodes(res)) == 26 and devices == {0, 1}


@needs_onednn
@pytest.mark.parametrize("name", ["squeezenet", "resnet50"])
def test_light_models_equal_the_reference(name):
    """Calibrated zoo models (their softmax not one-hot) against onnxruntime on the file."""
    model = zoo_model(name)
    inputs = zoo_input(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto")
    assert_close_to(run_hgrt(res, inputs), reference(model, inputs), rtol=1e-3)
    # squeezenet's 26, seven of them two each (split_concat: the squeeze convolution of a fire
    # module's concat; the eighth concat is read through a dropout)
    convs = {"squeezenet": 26 + 7, "resnet50": 53}[name]
    claimed = [n.attrs["onednn_op"] for n in _onednn_nodes(res)]
    assert sum(op.startswith("conv2d") for op in claimed) == convs
    if name == "resnet50":
        assert "dense+bias" in claimed and claimed.count("conv2d+batch_norm+add+relu") == 16


# ---- the choice, and oneDNN missing -----------------------------------------------------------

@needs_onednn
def test_auto_leaves_a_model_too_small_for_onednn_to_tvm(caplog):
    """conv_onnx's 8 -> 16 3x3 on 9x9 is 93k multiply-adds: a oneDNN call would cost more than
    TVM's kernel; ``kernels="onednn"`` still claims it, and a model as large as the limit is
    claimed by ``auto``."""
    small = conv_onnx()
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        auto = _check(small, kernels="auto")
    assert not _onednn_nodes(auto) and {r.kernels for r in auto.placement_report} == {"tvm"}
    assert any("per-call cost" in r.message for r in caplog.records)
    assert _onednn_nodes(_check(small, kernels="onednn"))
    big = conv_onnx(c=32, oc=32, hw=16)  # 32 x 32 x 9 x 16 x 16: 2.4M multiply-adds
    assert _onednn_nodes(_check(big, kernels="auto"))


def _roots(res):
    """The conv2d and matmul bindings of a build, in order, and who computes each."""
    return [(r.node, r.kernels) for r in res.placement_report
            if r.op in ("relax.nn.conv2d", "relax.matmul")]


@needs_onednn
def test_kernels_are_chosen_per_op_like_a_device():
    """An override by node beats a rule by op, which beats the default; next to a TVM
    convolution the oneDNN ones write and read NCHW themselves (no reorder node)."""
    model = _block_onnx()
    first, second, third = (name for name, _ in _roots(_check(model)))
    mixed = _check(model, kernels=hgrt.Kernels("onednn", overrides={second: "tvm"}))
    assert _roots(mixed) == [(first, "onednn"), (second, "tvm"), (third, "onednn")]
    assert [(n.attrs["onednn_op"], n.attrs["onednn_layouts"]) for n in _onednn_nodes(mixed)] \
        == [("conv2d+relu", "plain, plain"), ("conv2d", "plain, plain")]
    assert sum(n.op == "tvm_op" for n in mixed.graph.nodes) == 3  # the TVM conv + add + relu
    by_rule = _check(model, kernels=hgrt.Kernels("tvm", rules={"nn.conv*": "onednn"},
                                                  overrides={first: "tvm"}))
    assert _roots(by_rule) == [(first, "tvm"), (second, "onednn"), (third, "onednn")]
    dense = _check(_dense_onnx(gemm=False), kernels=hgrt.Kernels("onednn",
                                                                  rules={"matmul": "tvm"}))
    assert not _onednn_nodes(dense) and {k for _, k in _roots(dense)} == {"tvm"}


@needs_onednn
def test_an_override_claims_what_auto_leaves_and_refuses_what_onednn_cannot_compute():
    small = conv_onnx()  # too small for "auto" (see the test above)
    (name, kernels), = _roots(_check(small, kernels="auto"))
    assert kernels == "tvm"
    forced = _check(small, kernels=hgrt.Kernels("auto", overrides={name: "onednn"}))
    assert _roots(forced) == [(name, "onednn")] and len(_onednn_nodes(forced)) == 1
    # a weight that is an input of the model, not a constant: no packed weights to make
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 4, 3, 3), "float32"))
    with bb.function("main", [x, w], attrs={"num_input": 2}):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(relax.op.nn.conv2d(x, w, padding=1), "conv"))
        bb.emit_func_output(y)
    with pytest.raises(hgrt.BuildError, match=r"override 'conv'='onednn': oneDNN cannot "
                                              r"compute this relax.nn.conv2d"):
        hgrt.build(bb.finalize(), ["cpu"], params={},
                   kernels=hgrt.Kernels("tvm", overrides={"conv": "onednn"}))


@needs_onednn
def test_auto_weighs_the_whole_model_whoever_asked_for_its_other_ops():
    """A 32 -> 32 3x3 conv on 16x16 (2.4M multiply-adds: enough for auto) and a 32 -> 4096
    dense layer (a parallel TVM kernel would cost a switch): auto gives both to oneDNN, and so
    it does when a rule restates the conv's choice (auto's size rule counts every op oneDNN
    takes, not only auto's). (A 32 -> 10 one, 320 multiply-adds, is cheaper as TVM's serial
    kernel than as a oneDNN call: ``auto_choice.ONEDNN_CALL_US``.)"""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype("float32"), n)
             for n, s in (("w0", (32, 32, 3, 3)), ("fc", (4096, 32)), ("fb", (4096,)))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1] * 4),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("GlobalAveragePool", ["r0"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "conv_fc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    for kernels in ("auto", hgrt.Kernels("auto", rules={"nn.conv2d": "onednn"}),
                    hgrt.Kernels("onednn", rules={"matmul": "auto"})):
        assert {k for _, k in _roots(_check(model, kernels=kernels))} == {"onednn"}, kernels


def test_kernel_choices_name_what_exists():
    model = _block_onnx()
    with pytest.raises(hgrt.BuildError, match=r"override 'nope': is not a binding of main; "
                                              r"providers are chosen for convolutions, "
                                              r"matmuls, layer norms and softmaxes: "
                                              r"\['lv', 'lv"):
        hgrt.build(model, ["cpu"], kernels=hgrt.Kernels(overrides={"nope": "tvm"}))
    relu = next(r.node for r in hgrt.build(model, ["cpu"], kernels="tvm").placement_report
                if r.op == "relax.nn.relu")
    with pytest.raises(hgrt.BuildError, match=rf"override '{relu}': is a relax.nn.relu"):
        hgrt.build(model, ["cpu"], kernels=hgrt.Kernels(overrides={relu: "tvm"}))
    with pytest.raises(hgrt.BuildError, match=r"kernels rule 'matmul'='mkl': choose one of"):
        hgrt.build(model, ["cpu"], kernels=hgrt.Kernels(rules={"matmul": "mkl"}))
    with pytest.raises(hgrt.BuildError, match=r"a provider .* or hgrt.Kernels"):
        hgrt.build(model, ["cpu"], kernels={"matmul": "tvm"})
    # rules name ops: "conv2d" (not "nn.conv2d") or a relu would silently do nothing
    for rule in ("conv2d", "nn.relu"):
        with pytest.raises(hgrt.BuildError, match=rf"rule '{rule}' matches no op a provider is "
                                                  r"chosen for: \['matmul', 'nn.conv2d', "
                                                  r"'nn.layer_norm', 'nn.softmax'\]"):
            hgrt.build(model, ["cpu"], kernels=hgrt.Kernels(rules={rule: "tvm"}))
    with pytest.raises(hgrt.BuildError, match=r"Kernels rules=None: a dict from op pattern"):
        hgrt.build(model, ["cpu"], kernels=hgrt.Kernels(rules=None))


@pytest.fixture
def no_onednn(monkeypatch):
    reason = f"oneDNN not installed: {onednn.INSTALL_HINT}"
    monkeypatch.setattr(onednn, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(onednn_policy, "_said", set())
    return reason


def test_auto_without_onednn_builds_tvm_kernels_and_says_so_once(no_onednn, caplog):
    model = conv_onnx()
    with caplog.at_level(logging.WARNING, logger="hgrt.build"):
        res = _check(model, kernels="auto")
        _check(model, kernels="auto")
    assert not _onednn_nodes(res)
    assert [r.message for r in caplog.records] == [f"kernels: tvm ({no_onednn})"]
    assert {r.kernels for r in res.placement_report} == {"tvm"}


def test_onednn_without_onednn_is_a_build_error(no_onednn):
    with pytest.raises(hgrt.BuildError, match=r"kernels='onednn': oneDNN not installed: pip"):
        hgrt.build(conv_onnx(), ["cpu"], kernels="onednn")
    with pytest.raises(hgrt.BuildError, match=r"kernels rule 'nn.conv2d'='onednn': oneDNN not "
                                              r"installed"):
        hgrt.build(conv_onnx(), ["cpu"], kernels=hgrt.Kernels("tvm", {"nn.conv2d": "onednn"}))
    # nothing asks for oneDNN: no error, nothing said
    res = hgrt.build(conv_onnx(), ["cpu"], kernels=hgrt.Kernels("auto", {"nn.conv2d": "tvm"}))
    assert not _onednn_nodes(res)


def test_unknown_kernels_and_foreign_targets_are_refused():
    with pytest.raises(hgrt.BuildError, match="choose one of"):
        hgrt.build(conv_onnx(), ["cpu"], kernels="mkl")
    if REASON is None:
        arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
        with pytest.raises(hgrt.BuildError, match="x86-64 CPU"):
            hgrt.build(conv_onnx(), [arm], kernels="onednn")


def test_tvm_kernels_claim_nothing():
    res = hgrt.build(conv_onnx(), ["cpu"], kernels="tvm")
    assert not _onednn_nodes(res)


@needs_onednn
def test_the_profiler_counts_a_onednn_kernels_flops():
    """A oneDNN node's weights are a packed blob (no weight shape to count from): the node
    carries its FLOPs, and the profile's rates count its convolution as FLOPs."""
    import tvm

    res = _check(conv_onnx(c=8, oc=16, hw=9, k=3, bias=True, relu=True))
    (node,) = _onednn_nodes(res)
    assert int(node.attrs["flops"]) == 2 * (16 * 9 * 9) * (8 * 3 * 3)  # out x (C x KH x KW)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    m.set_input(**onnx_inputs(conv_onnx(c=8, oc=16, hw=9, k=3)))
    rep = m.profile(repeat=3)
    (op,) = [o for o in rep.ops if o.func == "hgrt.onednn.conv2d"]
    assert op.flops == 2 * (16 * 9 * 9) * (8 * 3 * 3)
    (rates,) = rep.rates().values()
    assert rates["flops_per_s"] > 0


# ---- Winograd ------------------------------------------------------------------------------

def _winograd_block_onnx(c=64, hw=24):
    """x → 1x1 conv + relu = a → 3x3 conv(a) + bias + a → relu → 1x1 conv → y: the 3x3
    convolution reads and writes NHWC between oneDNN kernels, its residual too."""
    rng = np.random.default_rng(3)

    def w(name, shape):
        fan_in = int(np.prod(shape[1:]))
        return numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(fan_in)).astype("float32"), name)

    inits = [w("w0", (c, 8, 1, 1)), w("w1", (c, c, 3, 3)), w("b1", (c,)), w("w2", (8, c, 1, 1))]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"]), helper.make_node("Relu", ["c0"], ["a"]),
             helper.make_node("Conv", ["a", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c1", "a"], ["s"]), helper.make_node("Relu", ["s"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "winograd", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, hw, hw])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@needs_onednn
def test_a_3x3_convolution_between_onednn_kernels_runs_as_winograd(caplog):
    model = _winograd_block_onnx()
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        res = _check(model, kernels=WINOGRAD_ALL)
    middle = _onednn_nodes(res)[1]
    assert middle.attrs["onednn_op"] == "conv2d(winograd)+bias+add+relu"
    assert middle.attrs["onednn_impl"].startswith("winograd_4x4_3x3+")
    assert middle.attrs["onednn_layouts"] == "acdb, acdb, acdb"
    assert "1 of 1 3x3 convolutions where Winograd F(4x4, 3x3) is faster run as Winograd, " \
        "their weights 0.4 MiB larger" in caplog.text  # 64 x 64 x (36 - 9) floats
    direct = _check(model, kernels=Kernels("onednn", winograd=False))
    assert _onednn_nodes(direct)[1].attrs["onednn_op"] == "conv2d+bias+add+relu"
    inputs = onnx_inputs(model)
    np.testing.assert_allclose(run_hgrt(res, inputs)[0], run_hgrt(direct, inputs)[0], **TOL)

    def packed_bytes(r):  # the oneDNN blobs (uint8 weights): Winograd's hold 36 numbers a filter
        return sum(v.nbytes for v in r.params.values() if v.dtype == np.uint8)

    assert packed_bytes(res) - packed_bytes(direct) >= (36 - 9) * 4 * 64 * 64


@needs_onednn
def test_winograd_stays_within_a_placement_budget(caplog):
    """Auto placement fills a device's weight budget with the model's weights; Winograd's
    (4x the bytes) are taken only where they still fit, else the convolution stays direct
    and the log says why."""
    model = _winograd_block_onnx()  # its 3x3 64 -> 64: 147 KiB of weights, 576 KiB Winograd
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    growth = (36 - 9) * 4 * 64 * 64

    def middle(budget):
        res = _check(model, ("cpu:0",), hgrt.Placement(auto=True, budgets={"cpu:0": budget}),
                     kernels=WINOGRAD_ALL)
        return _onednn_nodes(res)[1].attrs["onednn_op"]

    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        assert middle(weights + growth // 2) == "conv2d+bias+add+relu"
    assert "1 3x3 convolutions on cpu:0 kept direct: as Winograd their weights would not fit " \
        "its placement budget" in caplog.text
    assert middle(weights + 2 * growth) == "conv2d(winograd)+bias+add+relu"


@needs_onednn
def test_a_host_without_room_says_what_winograd_takes():
    res = _check(_winograd_block_onnx(), kernels=WINOGRAD_ALL)
    with pytest.raises(hgrt.ProvisionError, match=r"needs .* MiB on cpu:0: .*; 0.6 MiB of the "
                       r"weights are Winograd convolutions' \(built with Kernels"):
        hgrt.Host(["cpu:0"], budgets=1 << 16).add("net", res)
    direct = _check(_winograd_block_onnx(), kernels=Kernels("onednn", winograd=False))
    with pytest.raises(hgrt.ProvisionError) as e:
        hgrt.Host(["cpu:0"], budgets=1 << 16).add("net", direct)
    assert "Winograd" not in str(e.value)


NHWC = 1000  # stands for oneDNN's NHWC tag: the rule compares with the tag it is given


def _header(ic, oc, hw, k=3, stride=1, tags=True, pool=False, n=1):
    h = make_header("conv2d", (n, ic, hw, hw), (n, oc, hw // stride, hw // stride),
                          (k, k), (stride, stride), (k // 2,) * 4)
    if tags:
        for slot in ("src_tag", "dst_tag", "res_tag"):
            h[SLOT[slot]] = NHWC
    if pool:
        h[SLOT["pool_kh"]] = 3
    return h


@pytest.mark.parametrize("case, pays", [
    (dict(ic=64, oc=64, hw=56), True),  # resnet50's first stage: 1013 -> 522 us
    (dict(ic=256, oc=256, hw=14), True),  # 16 tiles, many channels: 940 -> 469 us
    (dict(ic=48, oc=192, hw=13), True),  # squeezenet, 16 tiles: 118 -> 79 us
    (dict(ic=128, oc=32, hw=56), True),  # densenet121, 196 tiles: 976 -> 455 us
    (dict(ic=128, oc=32, hw=14), False),  # 16 tiles, 32 outputs: 60 -> 51 us for 4x the bytes
    (dict(ic=128, oc=32, hw=14, n=3), True),  # tiles over the batch: 48
    (dict(ic=16, oc=32, hw=28), False),  # few channels: the transforms' work (AVX2 36 -> 40)
    (dict(ic=16, oc=64, hw=55), False),  # squeezenet's fire2, balance 12.8: 175 -> 239 us
    (dict(ic=32, oc=128, hw=27), True),  # squeezenet's fire4, balance 25.6: 176 -> 145 us
    (dict(ic=512, oc=512, hw=7), False),  # 4 tiles: 940 -> 1180 us in resnet50
    (dict(ic=64, oc=64, hw=56, k=1), False),
    (dict(ic=64, oc=64, hw=56, stride=2), False),
    (dict(ic=64, oc=64, hw=56, tags=False), False),  # NCHW: the transforms read NHWC
    (dict(ic=64, oc=64, hw=56, pool=True), False),
])
def test_winograd_is_chosen_where_it_measured_faster(case, pays):
    assert onednn_policy.winograd_pays(_header(**case), nhwc=NHWC) is pays


@pytest.mark.parametrize("value", ["no", -0.1, None])
def test_winograd_takes_a_bool_or_a_share(value):
    with pytest.raises(hgrt.BuildError, match=f"winograd={value!r}: True .*, False .* or the "
                       f"share"):
        Kernels.of(Kernels("onednn", winograd=value))
    assert Kernels.of(Kernels("onednn", winograd=0.5)).winograd == 0.5


@needs_onednn
def test_by_default_winograd_adds_at_most_its_share_of_the_weights(caplog):
    """The block's 3x3 convolution would grow its weights by 3x the model's (576 KiB over
    the 147 KiB 64 -> 64 3x3 and the small 1x1s): the default share keeps it direct and says
    what all would cost; a share that holds the growth takes it."""
    model = _winograd_block_onnx()
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    growth = (36 - 9) * 4 * 64 * 64
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        res = _check(model)
    assert _onednn_nodes(res)[1].attrs["onednn_op"] == "conv2d+bias+add+relu"
    assert "0 of 1 3x3 convolutions where Winograd F(4x4, 3x3) is faster run as Winograd" \
        in caplog.text and "all 1 would add 0.4 MiB" in caplog.text
    just = Kernels("onednn", winograd=growth / weights)
    assert _onednn_nodes(_check(model, kernels=just))[1].attrs["onednn_op"].startswith(
        "conv2d(winograd)")
    below = Kernels("onednn", winograd=0.99 * growth / weights)
    assert _onednn_nodes(_check(model, kernels=below))[1].attrs["onednn_op"].startswith(
        "conv2d+")


def _winograd_growth(res) -> int:
    return sum((36 - 9) * 4 * h[SLOT["ic"]] * h[SLOT["oc"]]
               for h in _headers(res) if h[SLOT["algo"]] == 1)


def _headers(res):
    return [v[:HEADER_INT64 * 8].view(np.int64) for v in res.params.values()
            if v.dtype == np.uint8]


def _planned(res) -> int:
    return sum(d.planned_bytes for d in res.memory_report)


@needs_onednn
@pytest.mark.parametrize("name", ["squeezenet",
                                  pytest.param("inception_v1", marks=pytest.mark.slow)])
def test_the_default_build_plans_at_most_1_1x_the_bytes_of_tvm_kernels(name):
    """Winograd's convolutions are chosen most output tiles first within 10 % of the model's
    weight bytes; with every one (winograd=True) the same models plan 1.47x and 1.61x."""
    model = zoo_model(name)
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = hgrt.build(model, ["cpu"])
        every = hgrt.build(model, ["cpu"], kernels=WINOGRAD_ALL)
        tvm_kernels = hgrt.build(model, ["cpu"], kernels="tvm")
    assert 0 < _winograd_growth(default) <= WINOGRAD_SHARE * weights
    assert _winograd_growth(every) > _winograd_growth(default)
    assert _planned(default) <= 1.10 * _planned(tvm_kernels)
    assert _planned(every) > 1.10 * _planned(tvm_kernels)  # what the rule is for
    # the largest outputs (most tiles) are taken first
    taken = sorted(int(h[SLOT["oh"]]) * int(h[SLOT["ow"]])
                   for h in _headers(default) if h[SLOT["algo"]] == 1)
    assert taken and taken[-1] == max(int(h[SLOT["oh"]]) * int(h[SLOT["ow"]])
                                      for h in _headers(every) if h[SLOT["algo"]] == 1)
    assert_close_to(run_hgrt(default, zoo_input(model)), reference(model, zoo_input(model)),
                    rtol=1e-3)


def test_the_profiler_counts_a_tvm_convolutions_flops_whatever_its_weight_layout():
    """TVM's CPU schedule blocks a convolution's weight by output channels (OIHW16o: O/16, I,
    H, W, 16): its FLOPs are the output x the weight's size per output channel, not x 16."""
    from hgrt.runtime.profiler import node_work, op_label

    res = hgrt.build(conv_onnx(c=8, oc=32, hw=9, k=3, bias=True, relu=True), ["cpu"],
                     kernels="tvm")
    g = res.graph
    (nid,) = [i for i, n in enumerate(g.nodes)
              if n.op == "tvm_op" and "conv" in op_label(n.func_name)]
    assert node_work(g, nid)[0] == 2 * (32 * 9 * 9) * (8 * 3 * 3)
