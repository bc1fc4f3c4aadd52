"""hgrt.build end to end on cpu(0) + cpu(1): placement, copies, params, errors, determinism."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
from hgrt.errors import BuildError, DeviceError
from hgrt.graph import COPY_FUNC, Graph
from hgrt.testing import alternating, conv_model, reference, run_hgrt, user_placed


@pytest.fixture(scope="module")
def model():
    return conv_model()


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype("float32")


@pytest.fixture(scope="module")
def want(model, x):
    """onnxruntime's output on the model file."""
    return reference(model, {"x": x})[0]


def graph_of(res) -> Graph:
    return res.graph


def test_single_device_matches_the_reference(model, x, want):
    res = hgrt.build(model, ["cpu"])
    g = graph_of(res)
    assert set(g.device_index) == {0}
    assert not any(n.func_name == COPY_FUNC for n in g.nodes)
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_alternating_two_cpus_match_the_reference(model, x, want):
    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    g = graph_of(res)
    assert set(g.device_index) == {0, 1}
    copies = [n for n in g.nodes if n.func_name == COPY_FUNC]
    assert copies, "an alternating placement needs copies"
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_one_copy_per_tensor_and_destination(model):
    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    g = graph_of(res)
    sources = [(n.inputs[0][:2], g.device_index[g.entry_id(i)])
               for i, n in enumerate(g.nodes) if n.func_name == COPY_FUNC]
    assert len(sources) == len(set(sources)), f"a tensor copied twice to one device: {sources}"
    # no ping-pong: the source of a copy is never itself the output of a copy
    for (src, _), in zip(sources, strict=True):
        assert g.nodes[src[0]].func_name != COPY_FUNC


def test_weight_used_on_two_devices_is_stored_on_both(model, x, want):
    # 's' is read by the Add (cpu:0) and the Mul (cpu:1)
    from hgrt.frontend import import_model
    from hgrt.relay_passes.place_devices import op_bindings

    mod, _ = import_model(model)
    ops = list(op_bindings(mod))
    add_name = [n for n, op in ops if op == "relax.add"][-2]
    mul_name = [n for n, op in ops if op == "relax.multiply"][0]
    placement = hgrt.Placement(overrides={add_name: "cpu:0", mul_name: "cpu:1"})
    res = hgrt.build(model, ["cpu:0", "cpu:1"], placement)
    g = graph_of(res)
    s_nodes = [i for i, n in enumerate(g.nodes) if n.op == "null" and n.name.startswith("s")]
    assert sorted(g.nodes[i].name for i in s_nodes) == ["s", "s@cpu:1"]
    assert {g.device_index[g.entry_id(i)] for i in s_nodes} == {0, 1}
    assert set(res.params) == set(g.params)
    np.testing.assert_array_equal(res.params["s"], res.params["s@cpu:1"])
    # weights are never copied at run time
    for n in g.nodes:
        if n.func_name == COPY_FUNC:
            assert g.nodes[n.inputs[0][0]].name not in g.params
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def test_params_are_not_baked_into_the_library(model, x, want):
    res = hgrt.build(model, ["cpu"], kernels="tvm")  # oneDNN refuses weights never loaded
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params({k: np.zeros_like(v) for k, v in res.params.items()})
    m.set_input("x", x)
    m.run()
    assert not np.allclose(m.get_output(0).numpy(), want)
    m.load_params(res.params)
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), want, rtol=1e-5, atol=1e-5)


def test_rule_places_convs_and_report_says_why(model):
    res = hgrt.build(model, ["cpu:0", "cpu:1"],
                     hgrt.Placement(rules={"nn.conv2d": "cpu:1"}, preferred="cpu:0"))
    rows = {r.op: r for r in res.placement_report}
    assert rows["relax.nn.conv2d"].device == "cpu:1"
    assert rows["relax.nn.conv2d"].reason == "rule 'nn.conv2d'"
    assert rows["relax.nn.relu"].device == "cpu:0"
    assert rows["relax.nn.relu"].reason == "preferred"
    assert "relax.nn.conv2d" in res.print_placement()


def test_precedence_hint_over_override_over_rule_over_preferred():
    """The most specific setting wins, and the report says which one decided each node."""

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((8,), "float32")):
            with R.dataflow():
                a = R.exp(x)
                b = R.hint_on_device(a, R.device(1, 0))
                c = R.add(b, b)
                d = R.multiply(c, c)
                e = R.subtract(d, x)
                f = R.multiply(e, e)
                R.output(f)
            return f

    placement = hgrt.Placement(rules={"relax.exp": "cpu:1", "mul*": "cpu:1"},
                               overrides={"a": "cpu:1", "d": "cpu:0", "e": "cpu:1"},
                               preferred="cpu:0", fallback="cpu:1")
    res = hgrt.build(Mod, ["cpu:0", "cpu:1"], placement)
    got = {r.node: (r.device, r.reason) for r in res.placement_report}
    assert got == {"a": ("cpu:0", "hint"), "c": ("cpu:0", "preferred"),
                   "d": ("cpu:0", "override"), "e": ("cpu:1", "override"),
                   "f": ("cpu:1", "rule 'mul*'")}
    table = res.print_placement().splitlines()
    assert table[0].split() == ["node", "op", "device", "kernels", "reason", "kernels_why"]
    assert any(line.split()[:3] == ["d", "relax.multiply", "cpu:0"] and "override" in line
               for line in table)
    x = np.arange(8, dtype="float32") / 8
    want = ((2 * np.exp(x)) ** 2 - x) ** 2
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5)


def test_bare_target_rule_with_two_cpus_is_refused_not_guessed(model):
    """Target("llvm") fits both CPUs of the list: hgrt names them instead of taking the first."""
    rule = hgrt.Placement(rules={"nn.conv2d": tvm.target.Target("llvm")})
    with pytest.raises(hgrt.DeviceError, match=r"rule 'nn.conv2d': target 'llvm' fits "
                                               r"\['cpu:0', 'cpu:1'\]; name one of them"):
        hgrt.build(model, ["cpu:0", "cpu:1"], rule)
    with pytest.raises(hgrt.DeviceError, match=r"fallback: device 'cpu' fits"):
        hgrt.build(model, ["cpu:0", "cpu:1"], hgrt.Placement(fallback="cpu"))
    # one CPU of that kind: the bare target and the bare kind name it
    res = hgrt.build(model, ["cpu:1"], hgrt.Placement(rules={"nn.conv2d": "cpu"}))
    assert {r.device for r in res.placement_report} == {"cpu:1"}


def test_fallback_default_is_device_zero(model):
    res = hgrt.build(model, ["cpu:1", "cpu:0"])
    assert {r.device for r in res.placement_report} == {"cpu:1"}
    assert {r.reason for r in res.placement_report} == {"fallback"}


def test_relax_planner_two_device_chain_runs_under_hgrt():
    """A chain on cpu:0, to_vdevice, a chain on cpu:1: Relax's StaticPlanBlockMemory carves the
    cpu:1 tensors out of cpu:0 storage (the VM fails); hgrt plans per device."""

    @I.ir_module
    class Chain:
        I.module_global_infos({"vdevice": [I.vdevice("llvm", 0), I.vdevice("llvm", 1)]})

        @R.function
        def main(x: R.Tensor((64,), "float32", "llvm:0")):
            with R.dataflow():
                a = R.add(x, x)
                b = R.multiply(a, a)
                c = R.add(b, x)
                d = R.to_vdevice(c, "llvm:1")
                e = R.multiply(d, d)
                f = R.add(e, d)
                g = R.multiply(f, f)
                R.output(g)
            return g

    x = np.random.default_rng(0).random(64).astype("float32")
    c = (x + x) ** 2 + x
    want = (c * c + c) ** 2
    vm_failed = False
    try:
        vm = relax.VirtualMachine(tvm.compile(Chain, "llvm"), [tvm.cpu(0), tvm.cpu(1)])
        out = vm["main"](tvm.runtime.tensor(x, tvm.cpu(0))).numpy()
        vm_failed = not np.allclose(out, want, rtol=1e-5)
    except Exception as e:
        vm_failed = "device_id" in str(e)
    res = hgrt.build(Chain, ["cpu:0", "cpu:1"])
    g = graph_of(res)
    assert [n.func_name for n in g.nodes].count(COPY_FUNC) == 1
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5)
    assert vm_failed, "Relax's VM now runs this two-device chain right (TVM 0.27's did not)"


def test_graph_json_contract(model):
    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    doc = json.loads(res.graph_json)
    g = Graph.from_json(doc)
    assert g.input_names() == ["x"]
    assert g.arg_nodes[0] == 0 and g.nodes[0].name == "x"
    for nid in g.arg_nodes[1:]:
        assert g.nodes[nid].name in g.params
    for n in g.nodes:
        if n.op == "tvm_op":
            assert n.attrs["flatten_data"] == "0"
            assert int(n.attrs["num_inputs"]) == len(n.inputs)
            if not n.func_name.startswith("__") and "provider" not in n.attrs:
                res.lib[n.func_name]  # every kernel is a symbol of the one library (a
                # provider's, oneDNN's, is a global function its runtime registers)
    assert all(off % 64 == 0 for off in g.storage_offset)
    assert len(g.pool_bytes) == 2
    assert res.devices == ["cpu:0", "cpu:1"]
    assert doc["hgrt"]["devices"] == ["cpu:0", "cpu:1"]  # what `hgrt run` uses by default


def test_cli_runs_artifacts_on_the_devices_they_were_built_for(model, x, want, tmp_path,
                                                               capsys):
    from hgrt.cli import main

    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    hgrt.save(str(tmp_path / "out"), res)
    np.save(tmp_path / "x.npy", x)
    rc = main(["run", str(tmp_path / "out"), "--input", f"x={tmp_path / 'x.npy'}",
               "--save-output", str(tmp_path / "y.npz")])
    assert rc == 0, capsys.readouterr()
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["arr_0"], want,
                               rtol=1e-5, atol=1e-5)


def test_build_is_deterministic(model):
    a = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    b = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    assert a.graph_json == b.graph_json


def test_memory_report(model):
    res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    assert [m.device for m in res.memory_report] == [0, 1]
    for m in res.memory_report:
        assert m.lower_bound <= m.planned_bytes <= m.no_reuse_bytes


def test_library_exports(model, tmp_path):
    res = hgrt.build(model, ["cpu"])
    path = str(tmp_path / "lib.so")
    res.lib.export_library(path)
    lib = tvm.runtime.load_module(path)
    x = np.ones((1, 3, 8, 8), "float32")
    m = hgrt.create(res.graph_json, lib, [tvm.cpu(0)])
    m.load_params(res.params)
    m.set_input("x", x)
    m.run()
    np.testing.assert_allclose(m.get_output(0).numpy(), run_hgrt(res, {"x": x})[0])


def test_device_errors(model):
    with pytest.raises(DeviceError, match="repeats"):
        hgrt.build(model, ["cpu", "cpu:0"])
    with pytest.raises(DeviceError,
                       match="device 'tpu': unknown kind 'tpu'; known: \\['c', 'cpu', 'cuda'"):
        hgrt.build(model, ["tpu"])
    with pytest.raises(DeviceError, match="not in the device list"):
        hgrt.build(model, ["cpu"], hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))


def test_unknown_override_lists_bindings(model):
    with pytest.raises(BuildError, match="known: "):
        hgrt.build(model, ["cpu"], hgrt.Placement(overrides={"nope": "cpu"}))


def test_dynamic_shapes_are_refused_unless_given():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "dyn", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(BuildError, match="not static"):
        hgrt.build(model, ["cpu"])
    res = hgrt.build(model, ["cpu"], input_shapes={"x": [3, 4]})
    xs = np.linspace(-1, 1, 12, dtype="float32").reshape(3, 4)
    np.testing.assert_array_equal(run_hgrt(res, {"x": xs})[0], np.maximum(xs, 0))


def test_pass_failure_names_pass_and_history(monkeypatch, model):
    import importlib

    ic = importlib.import_module("hgrt.relay_passes.insert_copies")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(ic._Rebuilder, "on_device", broken)
    with pytest.raises(BuildError, match=r"'insert_copies' failed after \['place_devices'\]: "
                                         r"binding 'lv\d*' \(relax\.[\w.]+\) on cpu:0: boom") as e:
        hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    assert str(e.value.__cause__) == "boom"  # the failure itself, not the error that located it


def test_user_placed_relax_module_keeps_its_placement_and_folds_weights():
    """A Relax module that places itself (vdevices, R.to_vdevice between ops alternating over
    cpu:0 / cpu:1) with weight-only computations (Gemm transB: a transpose of each weight)."""
    rng = np.random.default_rng(2)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, rng.standard_normal(s).ravel())
             for n, s in (("w1", (16, 8)), ("b1", (16,)), ("w2", (4, 16)))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 4])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    mod, params = user_placed(model)
    res = hgrt.build(mod, ["cpu:0", "cpu:1"], params=params)
    assert {r.reason for r in res.placement_report} == {"hint"}
    assert {r.device for r in res.placement_report} == {"cpu:0", "cpu:1"}
    assert not any("transpose" in n.func_name for n in res.graph.nodes if n.op == "tvm_op")
    x = rng.standard_normal((2, 8)).astype("float32")
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-5, atol=1e-5)


def test_tvm_failure_names_pass_binding_op_and_device(monkeypatch):
    """A legalization of TVM's that fails with a bare AssertionError (here TVM's own rule for
    exp, wrapped to fail on a 3-D tensor): the BuildError says which pass, binding, op and
    device, the AssertionError is its cause."""
    import importlib

    lf = importlib.import_module("hgrt.relay_passes.legalize_and_fuse")  # (the module)
    rules = lf.vector_math_legalizations

    def failing_on_3d():
        table = dict(rules())
        exp = table.get("relax.exp") or tvm.ir.Op.get("relax.exp").get_attr("FLegalize")

        def legalize(bb, call):
            if len(call.args[0].ty.shape.values) == 3:
                raise AssertionError  # bare, as TVM's legalizations' asserts are
            return exp(bb, call)
        return {**table, "relax.exp": legalize}

    monkeypatch.setattr(lf, "vector_math_legalizations", failing_on_3d)

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32"), s: R.Tensor((3,), "float32")):
            with R.dataflow():
                a = R.exp(x)
                y = R.multiply(a, R.reshape(s, (3, 1)))
                R.output(y)
            return y

    with pytest.raises(BuildError, match=r"^'legalize_and_fuse' failed after \[.*\]: binding 'a' "
                                         r"\(relax.exp\) on cpu:1: AssertionError") as e:
        hgrt.build(Mod, ["cpu:0", "cpu:1"], hgrt.Placement(overrides={"a": "cpu:1"}),
                   params={"s": np.ones(3, "float32")})
    assert type(e.value.__cause__) is AssertionError


def test_a_prelu_slope_that_fits_no_axis_is_named_at_import():
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32"), s: R.Tensor((3,), "float32")):
            with R.dataflow():
                y = R.nn.prelu(R.exp(x), s, axis=2)
                R.output(y)
            return y

    with pytest.raises(BuildError, match=r"prelu of .*\[2, 3, 4\]: its slope of 3 values fits "
                                         r"no axis"):
        hgrt.build(Mod, ["cpu:0", "cpu:1"], params={"s": np.ones(3, "float32")})


def test_graph_of_inputs_and_weights_rearranged_builds_without_kernels():
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((3,), "float32"), w: R.Tensor((3,), "float32")):
            with R.dataflow():
                out = (w, x, x)
                R.output(out)
            return out

    x, w = np.arange(3, dtype="float32"), np.ones(3, "float32")
    res = hgrt.build(Mod, ["cpu:0"], params={"w": w})
    assert not [n for n in res.graph.nodes if n.op == "tvm_op"]
    for got, want in zip(run_hgrt(res, {"x": x}), (w, x, x), strict=True):
        np.testing.assert_array_equal(got, want)


def test_library_build_failure_names_the_kernel_binding_and_device(monkeypatch):
    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((8,), "float32")):
            return R.exp(x)

    real = tvm.tirx.build

    def build_without_exp(mod, *args, **kwargs):  # as if TVM had no code for exp
        if any("exp" in gv.name_hint for gv in mod.get_global_vars()):
            raise RuntimeError("no code for exp")
        return real(mod, *args, **kwargs)

    monkeypatch.setattr(tvm.tirx, "build", build_without_exp)
    with pytest.raises(BuildError, match=r"'build_library' failed after \[.*\]: binding '\w+' "
                                         r"\(\w*exp\w*\) on cpu:1: no code for exp"):
        hgrt.build(Mod, ["cpu:0", "cpu:1"], hgrt.Placement(rules={"exp": "cpu:1"}))
