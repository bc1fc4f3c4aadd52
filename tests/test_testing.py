"""hgrt.testing's oracles and calibrated weights: the whole-model checks see numbers."""

from __future__ import annotations

import numpy as np
import pytest

from hgrt.testing import (
    LOGITS_STD,
    assert_close_to,
    calibrated,
    one_hot_rows,
    onnx_reference,
    reference,
    zoo_input,
    zoo_model,
)
from hgrt.zoo import LIGHT_MODELS, light_input, light_model

# the zoo models each default test run builds; the others (vgg19, alexnet, zfnet512 carry 240 to
# 548 MiB of weights) run with -m slow
QUICK = ("squeezenet", "inception_v1", "inception_v2", "resnet50", "shufflenet", "densenet121")


def _logits(model, x):
    from hgrt.testing.models import _last_layer

    name, _ = _last_layer(model)
    return onnx_reference(model, x, [name])[0]


def _check_calibrated(name):
    model = zoo_model(name)
    x = zoo_input(model)
    out = reference(model, x)[0]
    assert np.isfinite(out).all()
    assert one_hot_rows(out) == 0, f"{name}: the calibrated output is one-hot"
    np.testing.assert_allclose(np.std(_logits(model, x)), LOGITS_STD, rtol=1e-3)
    if out.min() >= 0:  # a softmax: more than one class carries weight
        assert np.sort(out.reshape(-1))[-2] > 1e-3 * out.max()


@pytest.mark.parametrize("name", QUICK)
def test_calibrated_zoo_models_are_not_one_hot(name):
    _check_calibrated(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LIGHT_MODELS if n not in QUICK])
def test_calibrated_large_zoo_models_are_not_one_hot(name):
    _check_calibrated(name)


@pytest.mark.parametrize("name", ["resnet50", "shufflenet"])
def test_uncalibrated_random_weights_are_one_hot(name):
    """What the calibration is for: the zoo's random weights alone end these in a one-hot
    softmax, and the check the whole-model tests make refuses it."""
    model = light_model(name)
    x = light_input(model)
    out = reference(model, x)
    assert one_hot_rows(out[0]) == 1
    with pytest.raises(AssertionError, match="one-hot"):
        assert_close_to(out, out)


def test_calibration_scales_only_the_last_layer():
    raw = light_model("squeezenet")
    model = calibrated(raw, light_input(raw), std=1.5)
    changed = [a.name for a, b in zip(raw.graph.initializer, model.graph.initializer, strict=True)
               if a.raw_data != b.raw_data]
    assert len(changed) == 2, changed  # the last convolution's weight and bias
    np.testing.assert_allclose(np.std(_logits(model, light_input(raw))), 1.5, rtol=1e-3)


def test_assert_close_to_sees_a_wrong_number():
    model = zoo_model("squeezenet")
    x = zoo_input(model)
    want = reference(model, x)
    got = [w.copy() for w in want]
    flat = got[0].reshape(-1)
    flat[np.argsort(flat)[-2]] *= 1.01  # the second class off by 1 %
    with pytest.raises(AssertionError):
        assert_close_to(got, want)
    assert_close_to(want, want)


def test_an_ir_version_onnxruntime_refuses_falls_back_to_the_reference_evaluator():
    """An onnx package newer than the installed onnxruntime writes models of an IR version
    onnxruntime refuses: the oracle then runs ONNX's reference evaluator, never fails."""
    from onnx import TensorProto, helper

    pytest.importorskip("onnxruntime")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 99
    out = onnx_reference(model, {"x": np.array([-1.0, 0.5, 2.0], "float32")})
    np.testing.assert_array_equal(out[0], [0.0, 0.5, 2.0])
