"""fold_batch_norm: a batch norm whose statistics are weights runs as x * scale + shift (no
square root or division per element), with TVM kernels and on two devices; one whose
statistics arrive as inputs is left as it is; outputs equal the Relax VM's."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
from hgrt.testing import build_and_compare, reference, run_hgrt

TOL = {"rtol": 1e-5, "atol": 1e-5}
C = 8


def _model(stats_as_inputs: bool = False, gamma_read_elsewhere: bool = False):
    """x -> batch norm -> relu -> conv -> batch norm (no scale flag in ONNX: gamma given) = y;
    with ``stats_as_inputs`` the first batch norm's mean and var are model inputs; with
    ``gamma_read_elsewhere`` its gamma is also a second output's operand (z = g0 * s, s an
    input: a computation of weights alone is done at build)."""
    rng = np.random.default_rng(0)
    inits, inputs = [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 6, 6])]

    def vec(name, positive=False):
        v = rng.standard_normal(C).astype("float32")
        inits.append(numpy_helper.from_array(np.abs(v) + 0.5 if positive else v, name))
        return name

    w = rng.standard_normal((C, C, 3, 3)).astype("float32") / 9
    inits.append(numpy_helper.from_array(w, "w"))
    if stats_as_inputs:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [C]) for n in ("m0", "v0")]
        m0, v0 = "m0", "v0"
    else:
        m0, v0 = vec("m0"), vec("v0", True)
    nodes = [
        helper.make_node("BatchNormalization", ["x", vec("g0"), vec("b0"), m0, v0], ["bn0"],
                         epsilon=1e-3),
        helper.make_node("Relu", ["bn0"], ["r"]),
        helper.make_node("Conv", ["r", "w"], ["c"], pads=[1] * 4),
        helper.make_node("BatchNormalization", ["c", vec("g1"), vec("b1"), vec("m1"),
                                                vec("v1", True)], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if gamma_read_elsewhere:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [C]))
        nodes.append(helper.make_node("Mul", ["g0", "s"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "bn", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _check(model, devices, feeds, placement=None):
    return build_and_compare(model, devices, placement, "tvm", feeds, **TOL)


def _kernels(res) -> list[str]:
    return [n.func_name for n in res.graph.nodes if n.op == "tvm_op"]


@pytest.mark.parametrize("devices", [["cpu"], ["cpu:0", "cpu:1"]])
def test_batch_norms_with_weight_statistics_become_scale_and_shift(devices):
    """On one device each folds into its neighbour's kernel; on two (batch norms on cpu:1,
    the rest on cpu:0) the new weights live where their batch norm runs."""
    x = np.random.default_rng(1).standard_normal((1, C, 6, 6)).astype("float32")
    two = len(devices) == 2
    placement = hgrt.Placement(rules={"nn.batch_norm": "cpu:1"}, fallback="cpu:0") if two \
        else None
    res = _check(_model(), devices, {"x": x}, placement)
    kernels = _kernels(res)
    assert not [k for k in kernels if "sqrt" in k or "divide" in k], kernels
    names = set(res.params)
    assert {"g0.bn_scale", "g0.bn_shift", "g1.bn_scale", "g1.bn_shift"} <= names, names
    assert not names & {"g0", "b0", "m0", "v0", "g1", "b1", "m1", "v1"}, names
    g = res.graph
    if not two:  # one kernel per batch norm: with the relu after it, with the conv before it
        assert any("multiply" in k and "relu" in k for k in kernels), kernels
        assert any("conv2d" in k and "multiply" in k for k in kernels), kernels
        return
    on = {g.nodes[i].name: g.device_index[g.entry_id(i)] for i, n in enumerate(g.nodes)}
    assert {on[f"{p}.{k}"] for p in ("g0", "g1") for k in ("bn_scale", "bn_shift")} == {1}
    assert {g.device_index[g.entry_id(i)] for i, n in enumerate(g.nodes)
            if "multiply" in (n.func_name or "")} == {1}


def test_statistics_given_as_inputs_are_left_to_lowering():
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((1, C, 6, 6)).astype("float32"),
             "m0": rng.standard_normal(C).astype("float32"),
             "v0": np.abs(rng.standard_normal(C)).astype("float32") + 0.5}
    res = _check(_model(stats_as_inputs=True), ["cpu"], feeds)
    kernels = _kernels(res)
    assert [k for k in kernels if "sqrt" in k], kernels  # the first: per element, as before
    assert {"g1.bn_scale", "g1.bn_shift"} <= set(res.params)  # the second folded


def test_a_statistic_read_by_another_op_is_not_folded():
    """g0 stays a weight that load_params can change for both of its readers alike."""
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, C, 6, 6)).astype("float32"),
             "s": rng.standard_normal(C).astype("float32")}
    res = _check(_model(gamma_read_elsewhere=True), ["cpu"], feeds)
    assert [k for k in _kernels(res) if "sqrt" in k], _kernels(res)  # the first, as before
    names = set(res.params)
    assert "g0" in names and "g0.bn_scale" not in names and "g1.bn_scale" in names, names


@pytest.mark.parametrize("axis", [3, -1])
def test_a_channels_last_batch_norm_broadcasts_along_its_axis(axis):
    """A Relax model's NHWC batch norm (what channels_last makes between oneDNN kernels, here
    without oneDNN): scale and shift of shape (C,), the result equal to the Relax VM's."""

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((1, 5, 5, C), "float32"), g: R.Tensor((C,), "float32"),
                 b: R.Tensor((C,), "float32"), m: R.Tensor((C,), "float32"),
                 v: R.Tensor((C,), "float32")):
            with R.dataflow():
                bn = R.nn.batch_norm(x, g, b, m, v, axis=axis, epsilon=1e-3, training=False)
                y = R.nn.relu(bn[0])
                R.output(y)
            return y

    rng = np.random.default_rng(4)
    params = {k: rng.standard_normal(C).astype("float32") for k in "gbm"}
    params["v"] = np.abs(rng.standard_normal(C)).astype("float32") + 0.5
    x = rng.standard_normal((1, 5, 5, C)).astype("float32")
    res = hgrt.build(Mod, ["cpu"], params=params, kernels="tvm")
    (got,) = run_hgrt(res, {"x": x})
    np.testing.assert_allclose(got, reference(Mod, [x], params)[0], **TOL)
    want = np.maximum((x - params["m"]) / np.sqrt(params["v"] + 1e-3) * params["g"]
                      + params["b"], 0)
    np.testing.assert_allclose(got, want, **TOL)
    assert res.params["g.bn_scale"].shape == (C,) and not set(res.params) & set("gbmv")
    assert not [k for k in _kernels(res) if "sqrt" in k], _kernels(res)
