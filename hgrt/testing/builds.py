"""Running ``hgrt.build`` results: on ``tvm.cpu(0)``, ``tvm.cpu(1)``, … (``run_hgrt``), against
onnxruntime (``build_and_compare``), under an adversarial placement that alternates ops between
devices (``alternating``), also written into the Relax module itself as a user would
(``user_placed``); and hgrt's own lowering of a model for the Relax VM (``fused_module``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import tvm

import hgrt
from hgrt.devices import format_device, parse_devices
from hgrt.testing.oracle import onnx_reference


def input_shape(model) -> list[int]:
    """The shape of the first graph input of an ONNX ModelProto."""
    return [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]


def fused_module(model: Any, devices: Any = "cpu", placement: hgrt.Placement | None = None
                 ) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """``model`` lowered by hgrt's own pipeline (``hgrt.compiler.lower_model``: placed, fused,
    each PrimFunc with its device's target, unscheduled) → (module, weights in ``main``'s
    parameter order, after the inputs), ready for ``run_lowered_vm(mod, [*inputs, *weights])``.
    """
    from hgrt.compiler import lower_model

    mod, weights = lower_model(model, devices, placement)
    main = mod["main"]
    n_in = int(main.attrs["num_input"]) if "num_input" in main.attrs else 0
    return mod, [weights[p.name] for p in main.params[n_in:]]


def alternating(model: Any, params: dict | None = None, n_devices: int = 2) -> hgrt.Placement:
    """Adversarial placement: op i goes to ``cpu:{i % n_devices}``."""
    from hgrt.frontend import import_model
    from hgrt.relay_passes.place_devices import op_bindings

    mod, _ = import_model(model, params)
    names = [n for n, _ in op_bindings(mod)]
    return hgrt.Placement(overrides={n: format_device("cpu", i % n_devices)
                                     for i, n in enumerate(names)})


def user_placed(model: Any, n_devices: int = 2) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """An ONNX ``model`` as a TVM user brings it (``from_onnx(keep_params_in_input=True)`` +
    ``detach_params``) and places it by hand, op i on ``cpu:{i % n_devices}``: vdevices in the
    module's global infos, ``R.to_vdevice`` where an operand lives elsewhere (hgrt's
    place_devices + insert_copies write them). Returns the module and ``params`` for
    ``hgrt.build``."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    from hgrt.relay_passes.insert_copies import insert_copies
    from hgrt.relay_passes.place_devices import op_bindings, place_devices
    from hgrt.relay_passes.util.context import BuildContext, Weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, detached = relax.frontend.detach_params(from_onnx(model, keep_params_in_input=True))
    main = mod["main"]
    weights = zip(main.params[int(main.attrs["num_input"]):], detached["main"], strict=True)
    names = [n for n, _ in op_bindings(mod)]
    placement = hgrt.Placement(overrides={n: format_device("cpu", i % n_devices)
                                          for i, n in enumerate(names)})
    ctx = BuildContext(parse_devices([format_device("cpu", i) for i in range(n_devices)]),
                       placement, weights=Weights({p.name: v.numpy() for p, v in weights}))
    mod = insert_copies(place_devices(mod, ctx), ctx)
    w = ctx.weights
    return mod, {p: w.values[w.source[n]] for p, n in w.graph_names.items() if n in w.source}


def input_names(model: Any) -> list[str]:
    """The user inputs of ``model`` as hgrt names them (the frontend may rename them)."""
    from hgrt.frontend import import_model

    mod, _ = import_model(model)
    main = mod["main"]
    return [p.name for p in main.params[: int(main.attrs["num_input"])]]


def run_hgrt(result, inputs: dict[str, np.ndarray], devices: list | None = None
             ) -> list[np.ndarray]:
    """Run an ``hgrt.build`` result once (default devices: ``tvm.cpu(i)`` for device i)."""
    devices = devices or [tvm.cpu(i) for i in range(len(result.devices))]
    m = hgrt.create(result.graph_json, result.lib, devices)
    m.load_params(result.params)
    for k, v in inputs.items():
        m.set_input(k, v)
    m.run()
    return [m.get_output(i).numpy() for i in range(m.get_num_outputs())]


def onnx_inputs(model: Any, seed: int = 1) -> dict[str, np.ndarray]:
    """Standard-normal float32 values for every input of the ONNX ``model`` (static shapes)."""
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype("float32") for i in model.graph.input}


def build_and_compare(model: Any, devices: Any = ("cpu",), placement: Any = None,
                      kernels: str = "tvm", inputs: dict[str, np.ndarray] | None = None,
                      rtol: float = 1e-4, atol: float = 1e-4):
    """``hgrt.build`` the ONNX ``model``, run it once on ``inputs`` (default ``onnx_inputs``)
    and assert every output equals onnxruntime's on the same file (``onnx_reference``) within
    ``rtol``/``atol``; the build result."""
    inputs = onnx_inputs(model) if inputs is None else inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, list(devices), placement, kernels=kernels)
    want = onnx_reference(model, inputs)
    got = run_hgrt(res, inputs)
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return res
