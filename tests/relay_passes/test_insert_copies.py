"""place_devices + insert_copies on small Relax modules: what the rebuilt IR looks like."""

from __future__ import annotations

import pytest
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
from hgrt.devices import parse_devices
from hgrt.errors import BuildError, DeviceError
from hgrt.relay_passes import (
    BuildContext,
    Placement,
    insert_copies,
    place_devices,
)
from hgrt.relay_passes.util.context import Weights


@I.ir_module
class Fan:
    @R.function
    def main(x: R.Tensor((4,), "float32"), w: R.Tensor((4,), "float32")):
        R.func_attr({"num_input": 1})
        with R.dataflow():
            a = R.add(x, w)          # cpu:0
            b = R.multiply(a, w)     # cpu:1: a copied, w stored on cpu:1 too
            c = R.subtract(a, x)     # cpu:1: a already there, x copied once
            d = R.add(b, c)          # cpu:1
            e = R.multiply(d, x)     # cpu:1: x already there
            f = R.add(e, a)          # cpu:0: e copied back, a is home
            R.output(f)
        return f


def run(mod, devices, placement, params=None):
    ctx = BuildContext(devices=parse_devices(devices), placement=placement,
                       weights=Weights(params or {}))
    placed = place_devices(mod, ctx)
    return insert_copies(placed, ctx), ctx


def bindings(mod):
    return [b for blk in mod["main"].body.blocks for b in blk.bindings]


def copies(mod):
    out = []
    for b in bindings(mod):
        v = b.value
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") == "relax.to_vdevice":
            out.append((v.args[0].name, int(v.attrs.dst_vdevice.vdevice_id)))
    return out


PLACE = Placement(overrides={"a": "cpu:0", "b": "cpu:1", "c": "cpu:1", "d": "cpu:1",
                             "e": "cpu:1", "f": "cpu:0"})


def test_one_copy_per_tensor_and_destination():
    mod, _ = run(Fan, ["cpu:0", "cpu:1"], PLACE, {"w": None})
    got = copies(mod)
    assert len(got) == len(set(got))
    assert sorted(got) == [("a", 1), ("e", 0), ("x", 1)]


def test_weight_lives_on_every_device_that_reads_it():
    mod, ctx = run(Fan, ["cpu:0", "cpu:1"], PLACE, {"w": None})
    params = [(p.name, int(p.ty.vdevice.vdevice_id)) for p in mod["main"].params]
    assert params == [("x", 0), ("w", 0), ("w_cpu_1", 1)]
    assert ctx.weights.graph_names["w_cpu_1"] == "w@cpu:1"
    assert ctx.weights.source == {"w": "w", "w@cpu:1": "w"}
    assert all(src not in ("w", "w_cpu_1") for src, _ in copies(mod))


def test_ops_read_operands_on_their_own_device():
    mod, _ = run(Fan, ["cpu:0", "cpu:1"], PLACE, {"w": None})
    assert relax.analysis.check_well_formed(mod)
    for b in bindings(mod):
        v = b.value
        if isinstance(v, relax.Call) and getattr(v.op, "name", "") != "relax.to_vdevice":
            devs = {int(a.ty.vdevice.vdevice_id) for a in v.args if isinstance(a, relax.Var)}
            assert devs == {int(b.var.ty.vdevice.vdevice_id)}, b.var.name


def test_single_device_adds_no_copy_and_keeps_names():
    mod, _ = run(Fan, ["cpu"], Placement(), {"w": None})
    assert copies(mod) == []
    assert [b.var.name for b in bindings(mod)][:6] == ["a", "b", "c", "d", "e", "f"]


def test_input_lives_with_its_first_reader():
    mod, _ = run(Fan, ["cpu:0", "cpu:1"], Placement(fallback="cpu:1"), {"w": None})
    assert int(mod["main"].params[0].ty.vdevice.vdevice_id) == 1
    assert copies(mod) == []


def test_placement_errors_name_what_exists():
    with pytest.raises(DeviceError, match=r"cuda.*not in the device list \['cpu:0', 'cpu:1'\]"):
        run(Fan, ["cpu:0", "cpu:1"], Placement(preferred="cuda"))
    with pytest.raises(BuildError, match="known: .*'a'"):
        run(Fan, ["cpu:0", "cpu:1"], Placement(overrides={"zz": "cpu:1"}))


def test_rule_patterns_exact_name_beats_pattern():
    ctx = BuildContext(devices=parse_devices(["cpu:0", "cpu:1"]),
                       placement=Placement(rules={"*": "cpu:1", "relax.add": "cpu:0"}))
    place_devices(Fan, ctx)
    by_op = {r.node: (r.device, r.reason) for r in ctx.placed.report}
    assert by_op["a"] == ("cpu:0", "rule 'relax.add'")
    assert by_op["b"] == ("cpu:1", "rule '*'")


def _refusal(nodes, inputs, outputs) -> str:
    from onnx import TensorProto, helper

    kinds = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64}
    g = helper.make_graph(
        nodes, "dynamic",
        [helper.make_tensor_value_info(n, kinds[t], s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, kinds[t], None) for n, t in outputs])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(hgrt.BuildError) as e:
        hgrt.build(model, ["cpu:0"])
    return str(e.value)


def test_a_shape_read_from_an_input_is_refused_before_anything_is_compiled():
    """Slice with its ends as a graph input (onnx node cases): the refusal came from the graph
    step, after the whole library was built, and did not say why the shape was not known."""
    from onnx import helper

    msg = _refusal([helper.make_node("Slice", ["x", "starts", "ends"], ["y"])],
                   [("x", "float32", [4, 6]), ("starts", "int64", [1]), ("ends", "int64", [1])],
                   [("y", "float32")])
    assert "'insert_copies' failed" in msg and "build_library" not in msg, msg
    assert "known only at run time, from the values of 'ends', 'starts';" in msg, msg
    assert "initializer" in msg


def test_a_data_dependent_shape_says_so():
    from onnx import helper

    msg = _refusal([helper.make_node("NonZero", ["x"], ["y"])], [("x", "float32", [4, 6])],
                   [("y", "int64")])
    assert "(relax.nonzero) is a MatchCast: a shape that is known only at run time" in msg, msg
