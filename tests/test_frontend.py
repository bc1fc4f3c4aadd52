"""ONNX import: quiet on the zoo, shapes known at build folded, data-dependent ones refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import hgrt
from hgrt.frontend import import_model
from hgrt.testing import case_inputs, load_case, run_hgrt
from hgrt.zoo import light_model


def test_zoo_import_prints_no_frontend_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import_model(light_model("squeezenet"))
    assert [str(w.message) for w in caught] == []


def _expand(shape_init: bool):
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [3])
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"])], "expand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 1])] + ([] if shape_init
                                                                           else [shape]),
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [3], [2, 3, 4])]
        if shape_init else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_shape_known_at_build_is_folded():
    res = hgrt.build(_expand(shape_init=True), ["cpu:0", "cpu:1"])
    x = np.arange(3, dtype="float32").reshape(3, 1)
    np.testing.assert_array_equal(run_hgrt(res, {"x": x})[0], np.broadcast_to(x, (2, 3, 4)))


@pytest.mark.parametrize("model", [_expand(shape_init=False),
                                   load_case("simple/test_expand_shape_model3").model_path])
def test_data_dependent_shape_is_refused_naming_the_op(model):
    with pytest.raises(hgrt.BuildError, match=r"binding '\w+' \(vm.builtin.tensor_to_shape\): "
                                              r"the shape is data-dependent \(read from 'shape'"):
        hgrt.build(model, ["cpu:0"])


def test_sequence_insert_at_a_negative_position():
    """ONNX inserts at n + p, TVM 0.27's import at n + p + 1 (the Relax VM gets it wrong)."""
    case = load_case("simple/test_sequence_model3")
    got = run_hgrt(hgrt.build(case.model_path, ["cpu:0"]), case_inputs(case))
    np.testing.assert_array_equal(got[0], case.outputs[0])


# ---- tvm.relax.frontend.nn modules ------------------------------------------------------------


def _mlp():
    from tvm.relax.frontend import nn

    class MLP(nn.Module):
        def __init__(self):
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(nn.relu(self.fc1(x)))

    rng = np.random.default_rng(0)
    values = {"fc1.weight": rng.standard_normal((16, 8), "float32"),
              "fc1.bias": rng.standard_normal(16, "float32"),
              "fc2.weight": rng.standard_normal((4, 16), "float32"),
              "fc2.bias": rng.standard_normal(4, "float32")}
    return MLP(), values


def _mlp_reference(x, v):
    h = np.maximum(x @ v["fc1.weight"].T + v["fc1.bias"], 0)
    return h @ v["fc2.weight"].T + v["fc2.bias"]


@pytest.mark.parametrize("weights_from", ["params", "data"])
def test_an_nn_module_builds_split_over_two_devices(weights_from):
    net, values = _mlp()
    kwargs = {"params": values} if weights_from == "params" else {}
    if weights_from == "data":
        for name, value in values.items():
            layer, attr = name.split(".")
            getattr(getattr(net, layer), attr).data = value
    res = hgrt.build(net, ["cpu:0", "cpu:1"], {"rules": {"relax.nn.relu": "cpu:1"}},
                     input_shapes={"x": [2, 8]}, **kwargs)
    assert {r.device for r in res.placement_report} == {"cpu:0", "cpu:1"}
    x = np.random.default_rng(1).standard_normal((2, 8), "float32")
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], _mlp_reference(x, values),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"input_shapes must name exactly \['x'\], got \[\]"),
    ({"input_shapes": {"y": [2, 8]}}, r"must name exactly \['x'\], got \['y'\]"),
    ({"input_shapes": {"x": [2, -8]}}, r"input_shapes\['x'\] = \[2, -8\]: expected sizes"),
    ({"input_shapes": {"x": 8}}, r"input_shapes\['x'\] = 8: expected sizes"),
    ({"input_shapes": {"x": [2, 8]}}, r"parameters \['fc1.weight', .*\] hold no data"),
    ({"input_shapes": {"x": [2, 8]}, "params": {"fc3.weight": np.ones(1)}},
     r"params \['fc3.weight'\] are not parameters of the module"),
])
def test_an_nn_module_without_shapes_or_weights_is_refused(kwargs, match):
    net, _ = _mlp()
    with pytest.raises(hgrt.BuildError, match=match):
        hgrt.build(net, ["cpu:0"], **kwargs)


def test_a_weight_of_another_shape_is_refused_at_build():
    net, values = _mlp()  # it failed only when the weights were loaded
    values["fc1.weight"] = values["fc1.weight"].T.copy()
    with pytest.raises(hgrt.BuildError, match=r"param 'fc1.weight' is float32\[8, 16\], but "
                                              r"main takes float32\[16, 8\]"):
        hgrt.build(net, ["cpu:0"], params=values, input_shapes={"x": [2, 8]})


def test_an_nn_module_keeps_the_kernels_it_brings():
    """``nn.op.tensor_expr_op`` adds a PrimFunc of its own beside forward."""
    from tvm import te
    from tvm.relax.frontend import nn

    class Doubled(nn.Module):
        def __init__(self):
            self.fc = nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return nn.op.tensor_expr_op(
                lambda a: te.compute(a.shape, lambda i, j: a[i, j] * 2.0, name="dbl"), "dbl",
                [self.fc(x)])

    net = Doubled()
    w = np.arange(16, dtype="float32").reshape(4, 4)
    res = hgrt.build(net, ["cpu:0"], params={"fc.weight": w}, input_shapes={"x": [1, 4]})
    x = np.ones((1, 4), "float32")
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], 2 * (x @ w.T), rtol=1e-6)


# ---- a Relax module placed by hand --------------------------------------------------------------


def _placed_by_hand(model, first: int):
    """TVM's Relax module of ``model`` (weights bound as constants), op i placed on
    cpu:{(i + first) % 2} with ``R.to_vdevice`` where an operand lives on the other device, as
    a Relax user writes it."""
    from tvm.relax.frontend.onnx import from_onnx

    from hgrt.devices import parse_devices
    from hgrt.relay_passes.insert_copies import insert_copies
    from hgrt.relay_passes.place_devices import op_bindings, place_devices
    from hgrt.relay_passes.util.context import BuildContext, Weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = from_onnx(model, sanitize_input_names=False)
    placement = hgrt.Placement(overrides={n: f"cpu:{(i + first) % 2}"
                                          for i, (n, _) in enumerate(op_bindings(mod))})
    ctx = BuildContext(parse_devices(["cpu:0", "cpu:1"]), placement, weights=Weights({}))
    return insert_copies(place_devices(mod, ctx), ctx)


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("rank", ["1d", "2d", "3d"])
def test_prelu_whose_slope_sits_on_the_other_device(rank, first):
    """Before opset 7 the slope is per channel; TVM's import gives it axis -1 after a reshape,
    which hgrt's import corrects also when the slope reaches the prelu through R.to_vdevice."""
    import onnx

    case = load_case(f"pytorch-converted/test_PReLU_{rank}_multiparam")
    mod = _placed_by_hand(onnx.load(case.model_path), first)
    assert "R.to_vdevice" in mod["main"].script()
    res = hgrt.build(mod, ["cpu:0", "cpu:1"])
    main = mod["main"]
    names = [p.name for p in main.params[:int(main.attrs["num_input"])]]
    got = run_hgrt(res, dict(zip(names, case_inputs(case).values(), strict=True)))
    np.testing.assert_allclose(got[0], case.outputs[0], rtol=1e-6, atol=1e-7)


def test_prelu_slope_that_fits_no_axis_is_named():
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.prelu(x, relax.const(np.ones(5, "float32")),
                                                   axis=2))
        bb.emit_func_output(out)
    with pytest.raises(hgrt.BuildError, match=r"relax.nn.prelu of x \[2, 3, 4\]: its slope of "
                                              r"5 values fits no axis"):
        hgrt.build(bb.get(), ["cpu:0"])
