"""Helpers for the compiler tests: ONNX backend cases from the onnx wheel, the Relax VM as the
reference, and running an ``hgrt.build`` result on cpu(0) + cpu(1)."""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.relay_passes.place_devices import op_bindings
from hgrt.zoo import LIGHT_MODELS, light_input, light_model  # noqa: F401 - re-exported

ONNX_DATA = os.path.join(os.path.dirname(__import__("onnx").__file__), "backend", "test", "data")
CASE_DIRS = ("pytorch-converted", "pytorch-operator", "simple")


@dataclass
class OnnxCase:
    name: str
    model_path: str
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def _read_pb(path: str) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def onnx_case_names() -> list[str]:
    names = []
    for d in CASE_DIRS:
        for path in sorted(glob.glob(os.path.join(ONNX_DATA, d, "*", "model.onnx"))):
            names.append(f"{d}/{os.path.basename(os.path.dirname(path))}")
    return names


def load_case(name: str) -> OnnxCase:
    root = os.path.join(ONNX_DATA, name)
    data = os.path.join(root, "test_data_set_0")
    ins = [_read_pb(p) for p in sorted(glob.glob(os.path.join(data, "input_*.pb")),
                                        key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
    outs = [_read_pb(p) for p in sorted(glob.glob(os.path.join(data, "output_*.pb")),
                                         key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
    return OnnxCase(name, os.path.join(root, "model.onnx"), ins, outs)


def alternating(model, params=None, n_devices: int = 2) -> hgrt.Placement:
    """Adversarial placement: op i goes to device i % n_devices."""
    mod, _ = import_model(model, params)
    names = [n for n, _ in op_bindings(mod)]
    return hgrt.Placement(overrides={n: f"cpu:{i % n_devices}" for i, n in enumerate(names)})


def input_names(model) -> list[str]:
    mod, _ = import_model(model)
    main = mod["main"]
    return [p.name for p in main.params[: int(main.attrs["num_input"])]]


def run_hgrt(result, inputs: dict[str, np.ndarray], devices=None) -> list[np.ndarray]:
    devices = devices or [tvm.cpu(i) for i in range(len(result.devices))]
    m = hgrt.create(result.graph_json, result.lib, devices)
    m.load_params(result.params)
    for k, v in inputs.items():
        m.set_input(k, v)
    m.run()
    return [m.get_output(i).numpy() for i in range(m.get_num_outputs())]


def run_relax_vm(model, inputs: list[np.ndarray], params=None) -> list[np.ndarray]:
    """The reference: the same imported model through tvm.compile + the Relax VM."""
    mod, weights = import_model(model, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    dev = tvm.cpu()
    main = mod["main"]
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    args += [tvm.runtime.tensor(weights[p.name], dev)
             for p in main.params[int(main.attrs["num_input"]):]]
    out = vm["main"](*args)
    return _flatten(out)


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for o in out for a in _flatten(o)]


def case_inputs(case: OnnxCase) -> dict[str, np.ndarray]:
    """The case's input arrays keyed by hgrt input name (initializers listed as inputs dropped)."""
    import onnx

    graph = onnx.load(case.model_path).graph
    inits = {t.name for t in graph.initializer}
    given = [a for i, a in zip(graph.input, case.inputs, strict=False) if i.name not in inits]
    return dict(zip(input_names(case.model_path), given, strict=True))


def check_case(case: OnnxCase, placement: str) -> None:
    """Build ``case`` (placement 'single' or 'alternating') and compare with expected outputs."""
    if placement == "single":
        res = hgrt.build(case.model_path, ["cpu:0"])
    else:
        res = hgrt.build(case.model_path, ["cpu:0", "cpu:1"], alternating(case.model_path))
    got = run_hgrt(res, case_inputs(case))
    assert len(got) == len(case.outputs)
    for g, want in zip(got, case.outputs, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4)


def conv_model(seed: int = 0) -> onnx.ModelProto:
    """x → Conv(w, b) → Relu → Flatten → Add(f, f) + Mul(f, w2): a weight used by two ops."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n)
             for n, s in (("w", (4, 3, 3, 3)), ("b", (4,)), ("s", (1, 256)))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Add", ["f", "s"], ["g"]),
             helper.make_node("Mul", ["g", "s"], ["h"]),
             helper.make_node("Add", ["h", "f"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [x], [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
