"""A power by a constant 2, 3 or 0.5 becomes products or a square root before lowering: CUDA's
fast math computes powf(x, 2) as exp2(2 * log2(x)), NaN for every negative x."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.testing import onnx_reference


def _rms(exponent: float) -> onnx.ModelProto:
    """y = x / sqrt(|mean(x ** exponent)| + eps), x of both signs: an RMSNorm's form."""
    nodes = [helper.make_node("Pow", ["x", "e"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["m"], axes=[-1], keepdims=1),
             helper.make_node("Abs", ["m"], ["b"]),
             helper.make_node("Add", ["b", "eps"], ["a"]),
             helper.make_node("Sqrt", ["a"], ["s"]),
             helper.make_node("Div", ["x", "s"], ["y"])]
    graph = helper.make_graph(
        nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        [numpy_helper.from_array(np.array(exponent, "float32"), "e"),
         numpy_helper.from_array(np.array(1e-6, "float32"), "eps")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _cuda_source(res: hgrt.BuildResult) -> str:
    return "".join(m.inspect_source() for m in res.lib.imports_ if m.kind == "cuda")


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_an_integer_power_builds_no_powf_for_a_gpu(exponent):
    res = hgrt.build(_rms(exponent), ["cuda:0", "cpu:0"],
                     hgrt.Placement(preferred="cuda:0", fallback="cpu:0"), cuda_arch="sm_90",
                     kernels="tvm")
    src = _cuda_source(res)
    assert src and "powf" not in src


def test_a_fractional_power_keeps_pow():
    res = hgrt.build(_rms(1.5), ["cuda:0", "cpu:0"],
                     hgrt.Placement(preferred="cuda:0", fallback="cpu:0"), cuda_arch="sm_90",
                     kernels="tvm")
    assert "powf" in _cuda_source(res)  # (the twin: the check above can fail)


@pytest.mark.parametrize("exponent", [2.0, 3.0, 0.5])
def test_products_are_right_on_negative_inputs(exponent):
    model = _rms(exponent)
    x = np.random.default_rng(5).normal(size=(4, 16)).astype("float32")
    if exponent == 0.5:
        x = np.abs(x)  # (a square root of a negative is NaN for onnxruntime too)
    want = onnx_reference(model, {"x": x})[0]
    res = hgrt.build(model, ["cpu"], kernels="tvm")
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    m.set_input(x=x)
    m.run()
    got = m.get_output(0).numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
