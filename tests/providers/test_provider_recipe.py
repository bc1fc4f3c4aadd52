"""A kernel provider added by the recipe of docs/architecture.md: its module (here
``numpy_relu.py``: a claim pass and a runtime in one file) and one ``register`` line. It runs
a model end to end, on one device and split over cpu:0 / cpu:1, against onnxruntime; the CLI
lists it; inspect and the profiler name it."""

from __future__ import annotations

import numpy as np
import numpy_relu  # tests/providers/numpy_relu.py: the provider's one module
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt import providers
from hgrt.cli import build_parser
from hgrt.testing import assert_close_to, reference, run_hgrt


@pytest.fixture
def numpy_provider():
    numpy_relu.calls[0] = 0
    providers.register(numpy_relu.PROVIDER)  # the recipe's one line
    yield numpy_relu.PROVIDER
    providers.unregister(numpy_relu.PROVIDER.name)


def _model():
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype("float32"), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 3, 3)).astype("float32"), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "r1"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "relus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("split", [False, True], ids=["one-device", "split"])
def test_a_registered_provider_runs_a_model_end_to_end(numpy_provider, split):
    model = _model()
    x = {"x": np.random.default_rng(1).normal(size=(1, 3, 8, 8)).astype("float32")}
    devices = ["cpu:0", "cpu:1"] if split else ["cpu"]
    placement = hgrt.Placement(rules={"nn.relu": "cpu:1"}, fallback="cpu:0") if split else None
    res = hgrt.build(model, devices, placement, kernels="numpy")
    ours = [n for n in res.graph.nodes if n.attrs.get("provider") == "numpy"]
    assert len(ours) == 2 and all(n.func_name == "test.numpy.relu" for n in ours)
    assert {r.kernels for r in res.placement_report if r.op == "relax.nn.relu"} == {"numpy"}
    if split:  # the provider's kernels run where placement put them
        assert {res.graph.entry_device(res.graph.entry_id(res.graph.nodes.index(n)))
                for n in ours} == {1}
    got = run_hgrt(res, x, [tvm.cpu(i) for i in range(len(devices))])
    assert numpy_relu.calls[0] == 2
    assert_close_to(got, reference(model, x), rtol=1e-5)


def test_a_provider_not_asked_for_claims_nothing(numpy_provider):
    res = hgrt.build(_model(), ["cpu"], kernels="tvm")
    assert not any(n.attrs.get("provider") == "numpy" for n in res.graph.nodes)


def test_the_cli_and_kernels_list_registered_providers(numpy_provider):
    kernels = next(a for a in build_parser()._subparsers._group_actions[0].choices["compile"]
                   ._actions if a.dest == "kernels")
    assert "numpy" in kernels.choices and "tvm" in kernels.choices
    providers.unregister("numpy")
    with pytest.raises(hgrt.BuildError, match="choose one of"):
        hgrt.build(_model(), ["cpu"], kernels=hgrt.Kernels("numpy"))


def test_the_profiler_labels_a_provider_kernel_by_its_op_attr(numpy_provider):
    res = hgrt.build(_model(), ["cpu"], kernels="numpy")
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    m.set_input("x", np.ones((1, 3, 8, 8), "float32"))
    report = m.profile(repeat=2)
    assert "numpy relu" in report.by_op()


def test_the_registry_refuses_clashes_and_names_what_exists():
    with pytest.raises(hgrt.BuildError, match="known: \\['onednn'"):
        providers.get("onedn")
    clash = providers.KernelProvider(name="other", func_prefix="hgrt.onednn.x")
    with pytest.raises(hgrt.BuildError, match="overlaps 'onednn'"):
        providers.register(clash)
    with pytest.raises(hgrt.BuildError, match="not one of"):
        providers.register(providers.KernelProvider(name="x", func_prefix="x.",
                                                    passes=(("late", "m:f"),)))
    assert providers.names() == ("onednn", "cudalibs")  # nothing refused was registered
