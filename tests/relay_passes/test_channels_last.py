"""channels_last: which tensors oneDNN builds keep NHWC, where they turn back to NCHW, and that
the outputs stay equal to the Relax VM."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import build_and_compare

REASON = onednn.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _weight_maker(rng, inits: list):
    """``w(name, *shape)``: a random weight of fan-in scale added to ``inits``; its name."""
    def w(name, *shape):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype("float32"), name))
        return name
    return w


def _branchy_onnx(lrn: bool = True, sigmoid: bool = False):
    """conv → max pool → two convs → concat → avg pool → batch norm [→ sigmoid] → relu → conv →
    global average pool (output ``y``); with ``lrn`` the avg pool's result also feeds an LRN
    (output ``z``) and a softmax over channels (an op with no NHWC form: output ``s``)."""
    rng = np.random.default_rng(0)
    inits = []

    w = _weight_maker(rng, inits)

    def vec(name, n, positive=False):
        v = rng.standard_normal(n).astype("float32")
        inits.append(numpy_helper.from_array(np.abs(v) + 0.5 if positive else v, name))
        return name

    nodes = [
        helper.make_node("Conv", ["x", w("w0", 16, 8, 3, 3)], ["c0"], pads=[1] * 4),
        helper.make_node("Relu", ["c0"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                         pads=[1] * 4),
        helper.make_node("Conv", ["p", w("w1", 16, 16, 1, 1)], ["b1"]),
        helper.make_node("Conv", ["p", w("w2", 16, 16, 3, 3)], ["b2"], pads=[1] * 4),
        helper.make_node("Concat", ["b1", "b2"], ["c"], axis=1),
        helper.make_node("AveragePool", ["c"], ["ap"], kernel_shape=[3, 3], strides=[1, 1],
                         pads=[1] * 4, count_include_pad=0),
        helper.make_node("BatchNormalization", ["ap", vec("g", 32), vec("be", 32),
                                                vec("m", 32), vec("v", 32, True)], ["bn"]),
        *([helper.make_node("Sigmoid", ["bn"], ["sg"])] if sigmoid else []),
        helper.make_node("Relu", ["sg" if sigmoid else "bn"], ["r"]),
        helper.make_node("Conv", ["r", w("w3", 16, 32, 1, 1)], ["d"]),
        helper.make_node("GlobalAveragePool", ["d"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if lrn:
        nodes.append(helper.make_node("LRN", ["ap"], ["z"], size=3))
        nodes.append(helper.make_node("Softmax", ["ap"], ["s"], axis=1))
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "zs"]
    graph = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 12, 12])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build_and_check(model, devices=("cpu",), placement=None):
    return build_and_compare(model, devices, placement, "onednn", **TOL)


def _by_func(res, name):
    return [n for n in res.graph.nodes if n.func_name == f"hgrt.onednn.{name}"]


def test_ops_between_onednn_kernels_run_nhwc_and_equal_the_relax_vm():
    res = _build_and_check(_branchy_onnx())
    g = res.graph

    def shape(node):
        return g.shapes[g.entry_id(g.nodes.index(node))]

    (concat,) = _by_func(res, "concat")
    assert shape(concat) == (1, 6, 6, 32)  # N, H, W, C
    # the max pool after the convolution of the input runs in its kernel, the avg pool alone;
    # the global average pool (a mean over H, W) is a oneDNN pool over the whole 6 x 6, its
    # N,1,1,C result a view away from the plain output y (no reorder, no reshape kernel)
    assert [shape(p) for p in _by_func(res, "pool")] == [(1, 6, 6, 32), (1, 1, 1, 16)]
    assert not [n for n in g.nodes if "reshape" in (n.func_name or "")]
    convs = _by_func(res, "conv2d")
    assert convs[0].attrs["onednn_op"] == "conv2d+relu+max_pool" and shape(convs[0]) == \
        (1, 6, 6, 16)
    assert [c.attrs["onednn_layouts"] for c in convs] == \
        ["plain, acdb"] + ["acdb, acdb"] * 3  # the model's input NCHW, the rest NHWC
    # batch norm + relu ran NHWC as x * scale + shift (per-channel values made at build, no
    # square root per element) + relu, one oneDNN kernel (claim_affine); the LRN (eight ops
    # as imported) is one oneDNN kernel on NHWC; reorders feed only the softmax and the output z
    (bn,) = _by_func(res, "affine")
    assert bn.attrs["onednn_op"] == "multiply+add+relu" and shape(bn) == (1, 6, 6, 32)
    assert "g.bn_scale.affine" in res.params and not {"m", "g.bn_scale"} & set(res.params)
    (lrn,) = _by_func(res, "lrn")
    assert shape(lrn) == (1, 6, 6, 32)
    assert not [n for n in g.nodes if "power" in (n.func_name or "")]
    reorders = _by_func(res, "to_nchw")
    assert [shape(r) for r in reorders] == [(1, 32, 6, 6)] * 2
    readers = {g.nodes[i].func_name for i, n in enumerate(g.nodes)
               for r in reorders if any(g.nodes[j] is r for j, *_ in n.inputs)}
    assert len(readers) == 1 and "softmax" in readers.pop()
    assert not [n for n in g.nodes if "transpose" in (n.func_name or "")]


def test_a_model_output_is_nchw_and_no_reorder_is_made_that_nothing_needs():
    res = _build_and_check(_branchy_onnx(lrn=False))
    # the global average pool reads NHWC and writes the (1, C, 1, 1) output
    assert not _by_func(res, "to_nchw")


def test_a_copy_to_another_device_gets_nchw():
    """The LRN's pool, power and division run on cpu:1: the avg pool's NHWC result is reordered
    to NCHW on cpu:0, then copied; the outputs equal the VM's."""
    placement = hgrt.Placement(rules={op: "cpu:1" for op in (
        "relax.power", "relax.nn.avg_pool3d", "relax.divide", "relax.squeeze")},
        preferred="cpu:0")
    res = _build_and_check(_branchy_onnx(), ["cpu:0", "cpu:1"], placement)
    g = res.graph
    sources = [g.nodes[n.inputs[0][0]] for n in g.nodes if n.func_name == "__copy"]
    reordered = [s for s in sources if s.func_name == "hgrt.onednn.to_nchw"]
    assert reordered and all(g.entry_device(g.entry_id(g.nodes.index(s))) == 0
                             for s in reordered)
    # nothing NHWC crosses devices: a copy's source is a reorder or no oneDNN node at all
    assert all(s.func_name == "hgrt.onednn.to_nchw" or not s.func_name.startswith("hgrt.")
               for s in sources)


def _shuffle_onnx():
    """conv → relu → ShuffleNet's channel shuffle (3 groups of 4) → depthwise conv (output
    ``y``); and an LRN of the model's input itself (NCHW: output ``z``)."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w0", rng.standard_normal((12, 8, 1, 1)).astype("float32")),
        ("w1", rng.standard_normal((12, 1, 3, 3)).astype("float32")),
        ("split", np.array([1, 3, 4, 12, 12], "int64")),
        ("join", np.array([1, 12, 12, 12], "int64")))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Reshape", ["r", "split"], ["g"]),
        helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "join"], ["s"]),
        helper.make_node("Conv", ["s", "w1"], ["y"], group=12, pads=[1] * 4),
        helper.make_node("LRN", ["x"], ["z"], size=5, alpha=1e-2, beta=0.5, bias=2.0),
    ]
    graph = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 12, 12])], [helper.make_tensor_value_info(
            n, TensorProto.FLOAT, None) for n in "yz"], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_channel_shuffle_between_convolutions_is_one_nhwc_kernel():
    res = _build_and_check(_shuffle_onnx())
    g = res.graph
    (shuffle,) = _by_func(res, "shuffle")
    assert g.shapes[g.entry_id(g.nodes.index(shuffle))] == (1, 12, 12, 12)
    assert [c.attrs["onednn_layouts"] for c in _by_func(res, "conv2d")] == \
        ["plain, acdb", "acdb, plain"]
    assert not [n for n in g.nodes if "transpose" in (n.func_name or "")]
    # the LRN of an NCHW tensor (the input) is left to TVM: its ops, no oneDNN kernel
    assert not _by_func(res, "lrn") and not _by_func(res, "to_nchw")
    # (its power by beta = 0.5 is a square root since powers_as_products)
    assert [n for n in g.nodes if "sqrt" in (n.func_name or "")]


def _shufflenet_unit_onnx(half_out: bool = False):
    """conv → split into halves → the second through a conv → concat → channel shuffle (2
    groups) → split → the second half through a conv → concat (output ``y``): ShuffleNetV2's
    unit, twice; with ``half_out`` the shuffle's first half is an output too (``h``)."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:])))
                                     .astype("float32"), n) for n, s in (
        ("w0", (16, 8, 1, 1)), ("w1", (8, 8, 1, 1)), ("w2", (8, 8, 3, 3)))]
    inits += [numpy_helper.from_array(np.array(v, "int64"), n) for n, v in (
        ("halves", [8, 8]), ("groups", [1, 2, 8, 10, 10]), ("join", [1, 16, 10, 10]))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Split", ["r", "halves"], ["a", "b"], axis=1),
        helper.make_node("Conv", ["b", "w1"], ["bc"]), helper.make_node("Relu", ["bc"], ["br"]),
        helper.make_node("Concat", ["a", "br"], ["cat"], axis=1),
        helper.make_node("Reshape", ["cat", "groups"], ["g"]),
        helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "join"], ["sh"]),
        helper.make_node("Split", ["sh", "halves"], ["h", "s2"], axis=1),
        helper.make_node("Conv", ["s2", "w2"], ["y2"], pads=[1] * 4),
        helper.make_node("Concat", ["h", "y2"], ["y"], axis=1),
    ]
    outs = ["y", "h"] if half_out else ["y"]
    graph = helper.make_graph(nodes, "unit", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 10, 10])], [helper.make_tensor_value_info(
            n, TensorProto.FLOAT, None) for n in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("half_out", [False, True])
def test_a_split_on_channels_between_convolutions_splits_nhwc(half_out):
    """ShuffleNetV2's halves stay NHWC: its splits cut runs of channels per pixel (oneDNN's
    kernels, on their threads), so its concat and shuffle are oneDNN's and nothing turns NCHW
    but the outputs (a half that is one too gets its own reorder)."""
    res = _build_and_check(_shufflenet_unit_onnx(half_out))
    g = res.graph
    splits = [n for n in g.nodes if "split" in (n.func_name or "")]
    nhwc = [n for n in splits if g.shapes[g.entry_id(g.nodes.index(n))] == (1, 10, 10, 8)
            and n.num_outputs == 2]
    assert len(splits) == len(nhwc) == 2
    assert {n.func_name for n in splits} == {"hgrt.onednn.split"}
    # the placement report says so too: the splits, concats and the shuffle's three ops
    rows = [r for r in res.placement_report if r.op in (
        "relax.split", "relax.concat", "relax.reshape", "relax.permute_dims")]
    assert len(rows) == 2 + 2 + 3 and all(
        r.kernels == "onednn" and r.kernels_why.startswith("channels last") for r in rows), rows
    assert len(_by_func(res, "shuffle")) == 1
    assert len(_by_func(res, "to_nchw")) == (2 if half_out else 1)


def _convnext_block_onnx():
    """stem conv → ConvNeXt's block (7x7 depthwise conv, to N,H,W,C, layer norm, dense, GELU,
    dense, layer scale, back to N,C,H,W, plus the block's input) → 1x1 conv (output ``y``)."""
    rng = np.random.default_rng(6)

    def arr(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or 1 / np.sqrt(np.prod(shape[1:]) or 1))
                ).astype("float32")
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w0", arr(16, 8, 1, 1)), ("dw", arr(16, 1, 7, 7)), ("gamma", arr(16, scale=0.5) + 1),
        ("beta", arr(16, scale=0.1)), ("w1", arr(16, 64, scale=0.25)), ("b1", arr(64, scale=0.1)),
        ("w2", arr(64, 16, scale=0.125)), ("ls", arr(16, scale=0.5)), ("w3", arr(8, 16, 1, 1)))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["stem"]),
        helper.make_node("Conv", ["stem", "dw"], ["d"], group=16, pads=[3] * 4),
        helper.make_node("Transpose", ["d"], ["dt"], perm=[0, 2, 3, 1]),
        helper.make_node("LayerNormalization", ["dt", "gamma", "beta"], ["ln"], axis=-1),
        helper.make_node("MatMul", ["ln", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"],
                                                                           ["a1"]),
        helper.make_node("Gelu", ["a1"], ["g"]),
        helper.make_node("MatMul", ["g", "w2"], ["m2"]), helper.make_node("Mul", ["m2", "ls"],
                                                                          ["sc"]),
        helper.make_node("Transpose", ["sc"], ["back"], perm=[0, 3, 1, 2]),
        helper.make_node("Add", ["back", "stem"], ["res"]),
        helper.make_node("Conv", ["res", "w3"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "convnext", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 8, 8, 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_transposes_between_nchw_and_nhwc_around_convolutions_are_views():
    """ConvNeXt's block: the depthwise convolution writes NHWC, so its transpose to N,H,W,C
    is a view of it; the transpose back of the dense layers' N,H,W,C result is an NHWC-held
    tensor that the residual add and the next convolution read as it is: no transpose kernel
    and no reorder (the last convolution writes NCHW itself)."""
    res = _build_and_check(_convnext_block_onnx())
    funcs = [n.func_name or "" for n in res.graph.nodes]
    assert not [f for f in funcs if "transpose" in f], funcs
    assert not _by_func(res, "to_nchw")


def _squeeze_excite_onnx(batch: int = 1):
    """conv → SiLU → squeeze-excite (mean over H, W, 1x1 conv, SiLU, 1x1 conv, sigmoid: the
    gate) → x * gate → 1x1 conv (output ``y``), EfficientNet's block."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal(s) / np.sqrt(np.prod(s[1:])))
                                     .astype("float32"), n) for n, s in (
        ("w0", (24, 8, 3, 3)), ("w1", (6, 24, 1, 1)), ("w2", (24, 6, 1, 1)),
        ("w3", (16, 24, 1, 1)))]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c"], pads=[1] * 4),
        helper.make_node("Sigmoid", ["c"], ["cs"]), helper.make_node("Mul", ["c", "cs"], ["a"]),
        helper.make_node("ReduceMean", ["a"], ["m"], axes=[2, 3], keepdims=1),
        helper.make_node("Conv", ["m", "w1"], ["s1"]),
        helper.make_node("Sigmoid", ["s1"], ["s1s"]), helper.make_node("Mul", ["s1", "s1s"],
                                                                       ["s2"]),
        helper.make_node("Conv", ["s2", "w2"], ["s3"]),
        helper.make_node("Sigmoid", ["s3"], ["gate"]),
        helper.make_node("Mul", ["a", "gate"], ["e"]),
        helper.make_node("Conv", ["e", "w3"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [batch, 8, 12, 12])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("batch", [1, 3])
def test_a_squeeze_excite_gate_multiplies_nhwc_without_a_reorder(batch):
    """The gate's (N, C, 1, 1) bytes are the (N, 1, 1, C) tensor that broadcasts over NHWC: the
    multiply (oneDNN's ``gate`` kernel) reads the convolution's NHWC result as it is, and writes
    NHWC for the next."""
    res = _build_and_check(_squeeze_excite_onnx(batch))
    g = res.graph
    assert not _by_func(res, "to_nchw")
    (mul,) = _by_func(res, "gate")
    assert g.shapes[g.entry_id(g.nodes.index(mul))] == (batch, 12, 12, 24)
    assert [c.attrs["onednn_layouts"] for c in _by_func(res, "conv2d")][-1] == "acdb, plain"


def test_tvm_kernels_beside_onednn_kernels_run_solo_when_they_only_move_elements():
    """Injective TVM kernels (op pattern <= 2 in the graph: the sigmoid + relu) on a device with
    oneDNN kernels run on their caller's thread alone; a reducing one (the softmax) keeps the
    thread share."""
    import tvm

    from hgrt.runtime.frames import bind_steps
    from hgrt.runtime.pools import StoragePools
    from hgrt.runtime.threads import restore_thread_count, set_thread_count, solo

    res = _build_and_check(_branchy_onnx(sigmoid=True))
    g = res.graph
    patterns = {n.func_name: int(n.attrs["op_pattern"]) for n in g.nodes
                if n.op == "tvm_op" and not n.func_name.startswith(("hgrt.", "__"))}
    assert patterns and all(0 <= p <= 8 for p in patterns.values())
    steps = bind_steps(g, res.lib, StoragePools(g, [tvm.cpu(0)]))
    wrapped = {g.nodes[s.node].func_name: hasattr(s.func, "__wrapped__") for s in steps}
    for name, p in patterns.items():
        assert wrapped[name] == (p <= 2), (name, p)
    assert any(wrapped.values()) and not all(wrapped[n] for n in patterns)
    assert not any(v for n, v in wrapped.items() if n.startswith("hgrt."))

    num_threads = tvm.get_global_func("runtime.NumThreads")
    seen = []
    try:
        set_thread_count(2)  # a share of 2 (on one core too: TVM starts the threads)
        solo(lambda: seen.append(num_threads()))()
        seen.append(num_threads())
    finally:
        restore_thread_count()
    assert seen == [1, 2]


def test_tvm_kernels_on_another_cpu_device_run_solo_too():
    """The sigmoid + relu on cpu:1, where no oneDNN kernel runs: oneDNN's threads spin on the
    cores every CPU device shares, so it runs solo as well; without oneDNN kernels nothing
    does."""
    import tvm

    from hgrt.runtime.frames import bind_steps
    from hgrt.runtime.pools import StoragePools

    placement = hgrt.Placement(rules={"relax.sigmoid": "cpu:1", "relax.nn.relu": "cpu:1"},
                               preferred="cpu:0")
    for kernels in ("onednn", "tvm"):
        res = build_and_compare(_branchy_onnx(sigmoid=True), ["cpu:0", "cpu:1"], placement,
                                kernels, **TOL)
        g = res.graph
        steps = bind_steps(g, res.lib, StoragePools(g, [tvm.cpu(0), tvm.cpu(1)]))
        on_1 = {g.nodes[s.node].func_name: hasattr(s.func, "__wrapped__") for s in steps
                if g.entry_device(g.entry_id(s.node)) == 1 and g.nodes[s.node].injective}
        assert any("sigmoid" in f for f in on_1), on_1
        assert not any(f.startswith("hgrt.onednn.") for f in on_1)
        assert all(w == (kernels == "onednn") for w in on_1.values()), (kernels, on_1)


def _inverted_residual_onnx(batch: int, c: int = 24):
    """MobileNetV2's block at ``batch`` samples: a 1x1 expansion with ReLU6, a 3x3 depthwise
    with ReLU6, a 1x1 projection plus the block's input (the residual), then a 1x1 convolution
    and a global average pool; 24 channels (not a whole number of 16-channel blocks)."""
    rng = np.random.default_rng(9)
    inits = []

    w = _weight_maker(rng, inits)

    six = [numpy_helper.from_array(np.float32(v), n) for n, v in (("lo", 0.0), ("hi", 6.0))]
    inits += six
    nodes = [helper.make_node("Conv", ["x", w("w0", c, 8, 3, 3)], ["x0"], pads=[1] * 4),
             helper.make_node("Conv", ["x0", w("w1", 6 * c, c, 1, 1)], ["e"]),
             helper.make_node("Clip", ["e", "lo", "hi"], ["e6"]),
             helper.make_node("Conv", ["e6", w("w2", 6 * c, 1, 3, 3)], ["d"], pads=[1] * 4,
                              group=6 * c),
             helper.make_node("Clip", ["d", "lo", "hi"], ["d6"]),
             helper.make_node("Conv", ["d6", w("w3", c, 6 * c, 1, 1)], ["pr"]),
             helper.make_node("Add", ["pr", "x0"], ["s"]),
             helper.make_node("Conv", ["s", w("w4", 32, c, 1, 1)], ["o"]),
             helper.make_node("GlobalAveragePool", ["o"], ["y"])]
    graph = helper.make_graph(nodes, "inverted_residual", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [batch, 8, 14, 14])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _bottleneck_onnx(c: int, depthwise: bool):
    """1x1 16 -> c, 3x3 c -> c (depthwise or one group), 1x1 c -> 32, global pool; 8 samples
    at 14x14."""
    rng = np.random.default_rng(3)
    inits = []

    w = _weight_maker(rng, inits)

    nodes = [helper.make_node("Conv", ["x", w("w0", c, 16, 1, 1)], ["a"]),
             helper.make_node("Relu", ["a"], ["ar"]),
             helper.make_node("Conv", ["ar", w("w1", c, 1 if depthwise else c, 3, 3)], ["b"],
                              pads=[1] * 4, group=c if depthwise else 1),
             helper.make_node("Relu", ["b"], ["br"]),
             helper.make_node("Conv", ["br", w("w2", 32, c, 1, 1)], ["o"]),
             helper.make_node("GlobalAveragePool", ["o"], ["y"])]
    graph = helper.make_graph(nodes, "bottleneck", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [8, 16, 14, 14])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("c,depthwise", [(64, False), (128, False), (64, True), (128, True)])
def test_only_tensors_around_a_depthwise_convolution_go_blocked(c, depthwise):
    """At 8 samples, tensors between convolutions go blocked only in a group with a depthwise
    convolution (the layers the blocked layout speeds up; a change of layout costs more than
    the others gain), and never around a 3x3 convolution of one group and
    ``NHWC_MIN_CHANNELS`` inputs (oneDNN's brgemm kernels on NHWC win there). Where they go,
    the 3x3's input is blocked; its result, which the last convolution reads to write NHWC
    for the pool, stays NHWC."""
    block, _ = onednn.blocked_tag()
    if not block:
        pytest.skip("no blocked layout below AVX2")
    res = _build_and_check(_bottleneck_onnx(c, depthwise))
    g = res.graph
    convs = [n for n in g.nodes if n.func_name == "hgrt.onednn.conv2d"]
    ranks = [len(g.shapes[g.entry_id(g.nodes.index(n))]) for n in convs[:2]]
    assert ranks == ([5, 4] if depthwise else [4, 4])


@pytest.mark.parametrize("batch", [1, 8])
def test_tensors_between_convolutions_go_blocked_from_batch_8(batch):
    """From ``BLOCKED_MIN_BATCH`` samples a tensor that only convolutions write and read (their
    input or residual, their other tensors blocked or plain) is held in oneDNN's nChw16c
    (nChw8c on AVX2) layout, its channels padded to whole blocks: the graph's tensor is N,
    C / block, H, W, block; a convolution from a blocked input to an NHWC output reorders its
    result. At one sample they stay NHWC. The numbers are onnxruntime's either way."""
    from hgrt.providers.onednn import blocked_layout

    res = _build_and_check(_inverted_residual_onnx(batch))
    g = res.graph
    block, _ = onednn.blocked_tag()
    convs = [n for n in g.nodes if n.func_name == "hgrt.onednn.conv2d"]
    assert len(convs) == 5
    shapes = [g.shapes[g.entry_id(g.nodes.index(n))] for n in convs[:4]]
    if batch >= blocked_layout.BLOCKED_MIN_BATCH and block:
        # the block's sum stays NHWC: the convolution reading it writes NHWC for the pool
        assert shapes == [(8, -(-24 // block), 14, 14, block), (8, 144 // block, 14, 14, block),
                          (8, 144 // block, 14, 14, block), (8, 14, 14, 24)]
        blocked = f"aBcd{block}b"  # oneDNN's name of nChw16c
        assert convs[3].attrs["onednn_layouts"] == f"{blocked}, acdb, {blocked}"
    else:
        assert [len(s) for s in shapes] == [4, 4, 4, 4]
