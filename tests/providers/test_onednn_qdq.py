"""QDQ models on oneDNN: a QuantizeLinear read only by a DequantizeLinear of the same scale and
zero point is a post-op of the convolution or dense layer before it (the grid: round, clip,
scale), and a layer whose input is dequantized from a grid and whose weights are an int8 grid
per output channel computes in int8 where the host has VNNI; against onnxruntime running the
same file as float ops (its QDQ fusions off, so that its int8 kernels' own requantization does
not enter the comparison)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import claim_onednn as claim
from hgrt.providers.onednn import kernels as onednn
from hgrt.providers.onednn.blob import (
    HEADER_INT64,
    HEADER_VERSION_INT8,
    HEADER_VERSION_QUANT,
    SLOT,
    SRC_DT,
)
from hgrt.providers.onednn.int8 import VNNI_ISAS, weight_grid
from hgrt.testing import run_hgrt

REASON = onednn.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")


class _Model:
    """An ONNX graph written node by node: initializers and QDQ pairs."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list = []
        self.inits: list = []

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def qdq(self, x: str, name: str, scale: float, zero: int, dtype: str,
            dq_scale: float | None = None) -> str:
        """x -> QuantizeLinear -> DequantizeLinear (of ``dq_scale`` where given)."""
        s = self.init(f"{name}_s", np.float32(scale))
        z = self.init(f"{name}_z", np.array(zero, dtype))
        s2 = s if dq_scale is None else self.init(f"{name}_s2", np.float32(dq_scale))
        self.nodes += [helper.make_node("QuantizeLinear", [x, s, z], [f"{name}_q"]),
                       helper.make_node("DequantizeLinear", [f"{name}_q", s2, z], [name])]
        return name

    def weight(self, name: str, shape: tuple[int, ...], axis: int = 0) -> str:
        """An int8 weight with a scale per index of ``axis``, dequantized."""
        w = self.rng.integers(-127, 128, shape).astype("int8")
        n = shape[axis]
        s = (self.rng.uniform(0.5, 1.5, n) / 127 / np.sqrt(np.prod(shape) / n)).astype(
            "float32")
        self.nodes.append(helper.make_node(
            "DequantizeLinear", [self.init(f"{name}_i8", w), self.init(f"{name}_ws", s),
                                 self.init(f"{name}_wz", np.zeros(n, "int8"))],
            [name], axis=axis))
        return name

    def model(self, inputs: dict[str, list[int]], out: str):
        graph = helper.make_graph(
            self.nodes, "qdq",
            [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv_block(dq_scale: float | None = None, c: int = 32, oc: int = 64, hw: int = 20):
    """A residual block as quantize_static writes it: the input on a uint8 grid, a 3x3
    convolution onto an int8 grid (zero point -128: a ReLU's range), the residual added and
    the sum onto a grid of its own."""
    m = _Model()
    x = m.qdq("x", "xq", 0.02, 128, "uint8")
    r = m.qdq("r", "rq", 0.03, -3, "int8")
    b = m.init("b", m.rng.standard_normal(oc).astype("float32") * 0.1)
    m.nodes.append(helper.make_node("Conv", [x, m.weight("w", (oc, c, 3, 3)), b], ["c"],
                                    pads=[1, 1, 1, 1]))
    m.nodes.append(helper.make_node("Add", [m.qdq("c", "cq", 0.01, -128, "int8", dq_scale), r],
                                    ["s"]))
    return m.model({"x": [1, c, hw, hw], "r": [1, oc, hw, hw]},
                   m.qdq("s", "y", 0.04, -5, "int8"))


def _dense_layer():
    m = _Model(1)
    x = m.qdq("x", "xq", 0.02, 0, "int8")
    m.nodes += [helper.make_node("MatMul", [x, m.weight("w", (64, 48))], ["m"]),
                helper.make_node("Add", ["m", m.init("b", np.full(48, 0.05, "float32"))],
                                 ["a"])]
    return m.model({"x": [5, 64]}, m.qdq("a", "y", 0.015, 128, "uint8"))


def _inputs(model, seed: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype("float32") for i in model.graph.input}


def _float_onnxruntime(model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _on_the_grid(got: np.ndarray, want: np.ndarray, step: float) -> None:
    """Equal but where a value sat between two steps of the grid: at most one step apart, on
    under 3 % of the elements. (A sum of two grids' values divided by a third's scale falls
    exactly between two steps often; x * (1 / s) and x / s round such a tie either way: TVM's
    own kernels of a residual block below differ from onnxruntime's on 1.3 % of its values,
    oneDNN's on 1.5 %.)"""
    diff = np.abs(got.astype("float64") - want)
    assert diff.max() <= step * 1.0001, f"{diff.max()} > one step {step}"
    assert np.mean(diff > step * 1e-3) < 0.03


def _onednn_ops(res) -> list[str]:
    return [n.attrs["onednn_op"] for n in res.graph.nodes
            if n.func_name in claim.FUNC_NAME.values()]


@pytest.mark.parametrize("kernels", ["onednn", "auto"])
def test_a_qdq_residual_block_is_one_onednn_kernel_on_the_grid(kernels):
    model = _conv_block()
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels=kernels)
    assert _onednn_ops(res) == ["conv2d+bias+quantize+add+quantize"]
    (blob,) = [v for v in res.params.values() if v.dtype == np.uint8]
    assert blob[:HEADER_INT64 * 8].view(np.int64)[SLOT["version"]] == HEADER_VERSION_QUANT
    _on_the_grid(run_hgrt(res, feeds)[0], _float_onnxruntime(model, feeds), 0.04)


def test_a_qdq_dense_layer_rounds_onto_a_uint8_grid():
    model = _dense_layer()
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    assert _onednn_ops(res) == ["dense+bias+quantize"]
    got, want = run_hgrt(res, feeds)[0], _float_onnxruntime(model, feeds)
    _on_the_grid(got, want, 0.015)
    assert got.min() >= -0.015 * 128 - 1e-6 and got.max() <= 0.015 * 127 + 1e-6
    assert len(np.unique(want)) > 20  # informative: many steps of the grid


def test_a_residual_after_the_grid_is_read_where_onednn_numbers_it():
    """conv c1 -> conv c2 -> grid -> + c1 -> 1x1 conv -> + c1: the second convolution's
    residual (NHWC, still read after it) is a binary post-op after the grid's four oneDNN
    post-ops, and its argument is numbered among them."""
    m = _Model(5)
    m.nodes += [helper.make_node("Conv", ["x", m.weight("w1", (16, 16, 3, 3))], ["c1"],
                                 pads=[1] * 4),
                helper.make_node("Conv", ["c1", m.weight("w2", (16, 16, 3, 3))], ["c2"],
                                 pads=[1] * 4)]
    m.nodes += [helper.make_node("Add", [m.qdq("c2", "d", 0.05, 3, "int8"), "c1"], ["a"]),
                helper.make_node("Conv", ["a", m.weight("w3", (16, 16, 1, 1))], ["c3"]),
                helper.make_node("Add", ["c3", "c1"], ["y"])]
    model = m.model({"x": [1, 16, 10, 10]}, "y")
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    assert "conv2d+quantize+add" in _onednn_ops(res)
    got, want = run_hgrt(res, feeds)[0], _float_onnxruntime(model, feeds)
    assert np.mean(np.abs(got - want) > 1e-3) < 0.03 and np.abs(got - want).max() < 0.2


def test_a_dequantize_of_another_scale_stays_outside_the_kernel():
    model = _conv_block(dq_scale=0.011)
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    assert _onednn_ops(res) == ["conv2d+bias"]
    _on_the_grid(run_hgrt(res, feeds)[0], _float_onnxruntime(model, feeds), 0.04)


# ---- int8 kernels ----------------------------------------------------------------------------

VNNI = REASON is None and onednn.isa() in VNNI_ISAS


def _header(res) -> np.ndarray:
    (blob,) = [v for v in res.params.values() if v.dtype == np.uint8]
    return blob[:HEADER_INT64 * 8].view(np.int64)


def _relu_grid_convolution(groups: int = 1, c: int = 32, hw: int = 14):
    """A ReLU's output on its grid (int8, zero point -128: uint8 zero 0) into a padded 3x3
    convolution (depthwise where ``groups`` is ``c``), its result onto a grid of its own."""
    m = _Model(3)
    m.nodes.append(helper.make_node("Relu", ["x"], ["r"]))
    x = m.qdq("r", "rq", 0.02, -128, "int8")
    b = m.init("b", m.rng.standard_normal(c).astype("float32") * 0.1)
    m.nodes.append(helper.make_node("Conv", [x, m.weight("w", (c, c // groups, 3, 3)), b], ["c"],
                                    pads=[1, 1, 1, 1], group=groups))
    return m.model({"x": [1, c, hw, hw]}, m.qdq("c", "y", 0.01, 5, "int8"))


@pytest.mark.parametrize("groups", [1, 32])
def test_a_convolution_of_a_relu_s_grid_computes_in_int8(groups):
    model = _relu_grid_convolution(groups)
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    want = _float_onnxruntime(model, feeds)
    if not VNNI:
        assert _onednn_ops(res) == ["conv2d+bias+quantize"]
    else:
        assert _onednn_ops(res) == ["conv2d(int8)+bias+quantize"]
        h = _header(res)
        assert h[SLOT["version"]] == HEADER_VERSION_INT8 and h[SLOT["src_dt"]] == SRC_DT["uint8"]
        assert h[SLOT["src_zp"]] == 0  # int8 -128 is uint8 0: the padding reads the grid's zero
    _on_the_grid(run_hgrt(res, feeds)[0], want, 0.01)
    assert len(np.unique(want)) > 20


def test_an_int8_dense_layer_takes_its_zero_point_into_the_bias():
    """An int8 grid of zero point 3 (uint8 131) into a dense layer: nothing pads a dense layer,
    so the zero point's share of each sum is a constant per output channel in the bias."""
    m = _Model(4)
    x = m.qdq("x", "xq", 0.03, 3, "int8")
    m.nodes += [helper.make_node("MatMul", [x, m.weight("w", (96, 40), axis=1)], ["m"]),
                helper.make_node("Add", ["m", m.init("b", np.full(40, -0.2, "float32"))],
                                 ["a"])]
    model = m.model({"x": [7, 96]}, m.qdq("a", "y", 0.02, -1, "int8"))
    feeds = _inputs(model)
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    assert _onednn_ops(res) == ["dense(int8)+bias+quantize" if VNNI else "dense+bias+quantize"]
    if VNNI:
        assert _header(res)[SLOT["src_zp"]] == 131
    want = _float_onnxruntime(model, feeds)
    _on_the_grid(run_hgrt(res, feeds)[0], want, 0.02)
    assert len(np.unique(want)) > 20


def test_a_padded_convolution_of_a_grid_with_a_zero_point_stays_float():
    """uint8 zero point 128 under a padded convolution: the border would read 0, not the grid's
    zero, in int8; the layer runs in float32 on the grid's numbers."""
    res = hgrt.build(_conv_block(), ["cpu"], kernels="onednn")
    assert _header(res)[SLOT["src_dt"]] == SRC_DT["float32"]


def test_int8_weights_are_recovered_bit_for_bit_or_not_at_all():
    rng = np.random.default_rng(7)
    q = rng.integers(-128, 128, (24, 3, 3, 3)).astype(np.int8)
    q[5] = 0  # a channel of zeros
    q[6] = rng.integers(-40, 41, (3, 3, 3))  # a channel whose peak is far from the grid's end
    for scale in (rng.uniform(1e-4, 1e-2, 24).astype(np.float32),  # per channel
                  np.full(24, np.float32(0.00731))):  # one for the tensor
        w = q.astype(np.float32) * scale[:, None, None, None]
        got = weight_grid(w)
        assert got is not None
        back = got[0].astype(np.float32) * got[1][:, None, None, None]
        assert np.array_equal(back, w)
        assert np.array_equal(got[0][[0, 1, 7]], q[[0, 1, 7]])
        w[3, 1, 1, 1] = np.nextafter(w[3, 1, 1, 1], np.float32(1))  # off the grid by one ulp
        assert weight_grid(w) is None
    assert weight_grid(rng.standard_normal((8, 16)).astype(np.float32)) is None


@pytest.mark.skipif(not VNNI, reason="int8 kernels need VNNI")
def test_a_header_with_a_grid_off_uint8_is_refused():
    import tvm

    model = _relu_grid_convolution()
    res = hgrt.build(model, ["cpu"], kernels="onednn")
    (name,) = [k for k, v in res.params.items() if v.dtype == np.uint8]
    blob = res.params[name].copy()
    blob[:HEADER_INT64 * 8].view(np.int64)[SLOT["src_zp"]] = 300
    x = tvm.runtime.tensor(np.zeros((1, 32, 14, 14), "float32"))
    out = tvm.runtime.tensor(np.zeros((1, 32, 14, 14), "float32"))
    with pytest.raises(Exception, match="bad int8 grid"):
        onednn.kernel_function(claim.FUNC_NAME["conv2d"])(
            x, tvm.runtime.tensor(blob), out)


def _dense_stack(qdq: bool, layers: int = 4, width: int = 512, rows: int = 128):
    """``layers`` dense layers of ``width`` on ``rows`` rows, each input on a uint8 grid and
    each weight an int8 grid per output channel (``qdq``), or the same in float32."""
    m = _Model(7)
    cur = "x"
    for i in range(layers):
        src = m.qdq(cur, f"q{i}", 0.05, 128, "uint8") if qdq else cur
        w = m.weight(f"w{i}", (width, width), axis=1)
        m.nodes += [helper.make_node("MatMul", [src, w], [f"m{i}"]),
                    helper.make_node("Add", [f"m{i}", m.init(f"b{i}", np.full(
                        width, 0.01, "float32"))], [f"a{i}"]),
                    helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        cur = f"r{i}"
    return m.model({"x": [rows, width]}, cur)


def test_auto_gives_onednn_the_dense_layers_it_computes_in_int8():
    """``"auto"`` models an int8 kernel at ``INT8_GAIN`` times oneDNN's float32 speed (where
    the host has VNNI and the layer's input and weights are grids): on AVX-512 with VNNI a run
    of QDQ dense layers goes to oneDNN in int8, where the same layers in float32 stay TVM's
    (as fast there). The numbers are onnxruntime's, on the grid."""
    from hgrt.devices import vector_isa
    from hgrt.devices.host_cpu import host_target

    quant, plain = (hgrt.build(_dense_stack(q), ["cpu"], kernels="auto") for q in (True, False))
    ops = _onednn_ops(quant)
    assert len(ops) >= len(_onednn_ops(plain))
    if VNNI and vector_isa(host_target()).name == "avx512":
        # (each but the last quantizes its result onto the next layer's grid itself)
        assert ops == ["dense(int8)+bias+relu+quantize"] * 3 + ["dense(int8)+bias+relu"]
        assert not _onednn_ops(plain)
    model = _dense_stack(True)
    feeds = _inputs(model)
    got, want = run_hgrt(quant, feeds)[0], _float_onnxruntime(model, feeds)
    # (exact products in int32 on the same grids: float32 rounding apart, one value at a
    # grid's rounding boundary could land a step away)
    assert np.linalg.norm(got - want) < 1e-3 * np.linalg.norm(want)
    assert np.std(want) > 0.01 and np.count_nonzero(want) > want.size // 4
