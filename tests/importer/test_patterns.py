"""Activation and normalisation subgraphs, in the forms torch's exporters write, import as one
op (``hgrt.importer.patterns``) and run as onnxruntime runs the original file, on one device
and split over cpu:0 / cpu:1; near misses stay as they were."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pattern_onnx_models as models
import pytest
import tvm
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.relay_passes.util.relax_util import bindings, callee, op_name
from hgrt.testing import assert_close_to, onnx_inputs, reference, run_hgrt

HARDSWISH = "hgrt_hardswish"
PIECES = {"relax.maximum", "relax.minimum", "relax.sigmoid", "relax.erf", "relax.tanh",
          "relax.mean", "relax.sqrt", "relax.subtract", "relax.divide", "relax.power",
          "relax.clip"}

# (case, model, the one op it becomes)
CASES = [
    ("clip_opset6", lambda: models.clip(opset=6), "relax.clip"),
    ("relu6_constant_nodes", lambda: models.clip("node", 13), "relax.clip"),
    ("relu6_initializers", lambda: models.clip("init", 17), "relax.clip"),
    ("silu", lambda: models.silu(), "relax.nn.silu"),
    ("silu_sigmoid_first", lambda: models.silu("init", sigmoid_first=True), "relax.nn.silu"),
    ("hardswish_onnx", lambda: models.hardswish("onnx"), HARDSWISH),
    ("hardswish_hardsigmoid", lambda: models.hardswish("hardsigmoid"), HARDSWISH),
    ("hardswish_relu6", lambda: models.hardswish("relu6", "init"), HARDSWISH),
    ("hardswish_relu6_scaled", lambda: models.hardswish("relu6_scaled"), HARDSWISH),
    ("gelu_torch", lambda: models.gelu_erf("torch"), "relax.nn.gelu"),
    ("gelu_dynamo", lambda: models.gelu_erf("dynamo", "init"), "relax.nn.gelu"),
    ("gelu_transformers", lambda: models.gelu_erf("transformers"), "relax.nn.gelu"),
    ("gelu_onnx", lambda: models.gelu_erf("onnx"), "relax.nn.gelu"),
    ("gelu_tanh_pow", lambda: models.gelu_tanh("pow"), "relax.nn.gelu_tanh"),
    ("gelu_tanh_cube", lambda: models.gelu_tanh("cube", "init"), "relax.nn.gelu_tanh"),
    ("gelu_tanh_onnx", lambda: models.gelu_tanh("onnx"), "relax.nn.gelu_tanh"),
    ("layer_norm_div", lambda: models.layer_norm("div"), "relax.nn.layer_norm"),
    ("layer_norm_rsqrt_opset18", lambda: models.layer_norm("rsqrt", "init", 18),
     "relax.nn.layer_norm"),
    ("layer_norm_twice", lambda: models.layer_norm("div", twice=True), "relax.nn.layer_norm"),
    ("layer_norm_plain", lambda: models.layer_norm("div", affine=False),
     "relax.nn.layer_norm"),
    ("layer_norm_onnx", lambda: models.layer_norm("onnx"), "relax.nn.layer_norm"),
    ("softmax", lambda: models.softmax(13), "relax.nn.softmax"),
    ("softmax_opset11", lambda: models.softmax(11), "relax.nn.softmax"),
]

# (case, model, the op it would have become): one constant off, an axis off, a piece read twice
NEAR_MISSES = [
    ("clip_bounds_crossed", lambda: models.clip(lo=6.0, hi=0.0), "relax.clip"),
    ("silu_sigmoid_read_twice", lambda: models.silu(read_twice=True), "relax.nn.silu"),
    ("hardswish_divided_by_5", lambda: models.hardswish("relu6", six=5.0), HARDSWISH),
    ("hardsigmoid_slope_off", lambda: models.hardswish("hardsigmoid", six=5.0), HARDSWISH),
    ("gelu_sqrt2_rounded", lambda: models.gelu_erf(sqrt2=1.414), "relax.nn.gelu"),
    ("gelu_tanh_cubic_off", lambda: models.gelu_tanh(cubic=0.0447), "relax.nn.gelu_tanh"),
    ("layer_norm_over_axis_1", lambda: models.layer_norm(axis=1), "relax.nn.layer_norm"),
]


def _ops(mod: tvm.IRModule) -> Counter:
    """How many times each op (a call_tir by its callee's name) is called in ``main``."""
    return Counter(callee(b.value)[0] if op_name(b.value) == "relax.call_tir"
                   else op_name(b.value) for b in bindings(mod["main"]))


@pytest.mark.parametrize("case,make,op", CASES, ids=[c[0] for c in CASES])
def test_imports_as_one_op(case, make, op):
    ops = _ops(import_model(make())[0])
    assert ops[op] == 1, ops
    assert not (set(ops) & PIECES) - {op}, ops


@pytest.mark.parametrize("case,make,op", NEAR_MISSES, ids=[c[0] for c in NEAR_MISSES])
def test_near_miss_is_left_as_it_is(case, make, op):
    ops = _ops(import_model(make())[0])
    assert ops[op] == 0, ops
    want = hgrt.build(make(), ["cpu:0"], kernels="tvm")  # and it still computes the model
    inputs = onnx_inputs(make())
    assert_close_to(run_hgrt(want, inputs), reference(make(), inputs))


# each pattern's forms run: one device with each kernels option, and split over two devices
RUN = ["relu6_initializers", "silu", "hardswish_relu6", "hardswish_onnx", "gelu_transformers",
       "gelu_tanh_cube", "layer_norm_rsqrt_opset18", "layer_norm_twice", "layer_norm_plain"]


@pytest.mark.parametrize("case", RUN)
@pytest.mark.parametrize("kernels,devices", [("tvm", 1), ("auto", 1), ("tvm", 2)])
def test_runs_as_onnxruntime(case, kernels, devices):
    model = dict((c[0], c[1]) for c in CASES)[case]()
    # split: the weight added before the pattern on cpu:1, the pattern and the rest on cpu:0
    placement = hgrt.Placement(rules={"add": "cpu:1"}, fallback="cpu:0") if devices == 2 \
        else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, [f"cpu:{i}" for i in range(devices)], placement,
                         kernels=kernels)
    if devices == 2:
        assert {row.device for row in res.placement_report} >= {"cpu:0", "cpu:1"}
    inputs = onnx_inputs(model)
    assert_close_to(run_hgrt(res, inputs), reference(model, inputs))


def _relax_module() -> tvm.IRModule:
    """SiLU then a LayerNorm written out, as a Relax module (a model handed in as Relax)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 16), "float32"))
    gamma = relax.Var("gamma", relax.TensorType((16,), "float32"))
    with bb.function("main", [x, gamma]):
        with bb.dataflow():
            s = bb.emit(relax.op.multiply(relax.op.sigmoid(x), x))
            mean = bb.emit(relax.op.mean(s, axis=[-1], keepdims=True))
            d = bb.emit(relax.op.subtract(s, mean))
            var = bb.emit(relax.op.mean(relax.op.multiply(d, d), axis=[-1], keepdims=True))
            root = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(1e-6, "float32"))))
            y = bb.emit_output(relax.op.multiply(relax.op.multiply(d, root), gamma))
        bb.emit_func_output(y)
    return relax.transform.Normalize()(bb.get())


def test_relax_module_gets_the_patterns():
    mod = _relax_module()
    params = {"gamma": np.linspace(0.5, 1.5, 16).astype("float32")}
    ops = _ops(import_model(mod, params)[0])
    assert ops["relax.nn.silu"] == 1 and ops["relax.nn.layer_norm"] == 1, ops
    assert not set(ops) & PIECES, ops
    x = np.random.default_rng(0).standard_normal((3, 16)).astype("float32")
    res = hgrt.build(mod, ["cpu:0", "cpu:1"], hgrt.Placement(rules={"nn.silu": "cpu:1"},
                                                              fallback="cpu:0"), params)
    assert_close_to(run_hgrt(res, {"x": x}), reference(mod, {"x": x}, params))
