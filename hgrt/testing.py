"""Test helpers that ship with hgrt (as ``tvm.testing`` / ``numpy.testing`` do with theirs).

What hgrt's tests and benchmark scripts share:

* the oracles, outside hgrt: ``reference`` runs an ONNX file on onnxruntime (or ONNX's
  reference evaluator), never through hgrt's import (``onnx_reference``), and a Relax module
  through ``tvm.compile`` + the Relax VM (``run_relax_vm``); ``run_lowered_vm`` runs an already
  lowered (fused) module, e.g. ``fused_module``'s;
* random weights that keep outputs informative: ``calibrated`` scales a model's last layer so
  its logits have a standard deviation of a few units (``zoo_model``: a calibrated zoo model),
  ``one_hot_rows`` counts outputs a comparison would see only the argmax of, and
  ``assert_close_to`` compares with the oracle and refuses a one-hot one;
* running an ``hgrt.build`` result on ``tvm.cpu(0)``, ``tvm.cpu(1)``, … (``run_hgrt``) and an
  adversarial placement that alternates ops between devices (``alternating``), also written
  into the Relax module itself as a user would (``user_placed``);
* the ONNX backend test cases of the onnx wheel (``onnx_case_names``, ``load_case``,
  ``case_inputs``, ``check_case``) and a small conv model (``conv_model``);
* for the runtime alone: TVM-built elementwise kernels (``elementwise_lib``) and a graph-JSON
  builder (``GraphBuilder``) on vectors of ``N`` floats.

>>> import numpy as np
>>> import hgrt
>>> from hgrt.testing import alternating, conv_model, reference, run_hgrt
>>> model = conv_model()
>>> x = np.ones((1, 3, 8, 8), "float32")
>>> res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
>>> got = run_hgrt(res, {"x": x})
>>> np.testing.assert_allclose(got[0], reference(model, {"x": x})[0], rtol=1e-5)

The heavy imports (onnx, the Relax stack) happen inside the functions that need them.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm

import hgrt
from hgrt.devices import format_device, parse_devices

__all__ = [
    "LOGITS_STD", "N", "GraphBuilder", "OnnxCase", "alternating", "assert_close_to",
    "calibrated", "case_inputs", "check_case", "conv_model", "elementwise_lib", "fused_module",
    "input_names", "input_shape", "load_case", "one_hot_rows", "onnx_case_names",
    "onnx_reference", "reference", "run_hgrt", "run_lowered_vm", "run_relax_vm", "user_placed",
    "zoo_input", "zoo_model",
]

N = 16  # the vector length of elementwise_lib's kernels and GraphBuilder's default shape
CASE_DIRS = ("pytorch-converted", "pytorch-operator", "simple")


# --- the Relax VM: the reference ---------------------------------------------------------------


def run_relax_vm(model: Any, inputs: list[np.ndarray], params: dict | None = None
                 ) -> list[np.ndarray]:
    """The reference for Relax modules: ``model`` (a Relax IRModule + ``params``, or a
    ``tvm.relax.frontend.nn`` module, as ``hgrt.build`` takes them) through ``tvm.compile`` and
    the Relax VM on the CPU. An ONNX model is imported by TVM's own frontend, without hgrt's
    rewrites (its oracle is ``onnx_reference``). ``inputs`` in ``main``'s order; returns every
    output, tuples flattened."""
    from tvm import relax

    if _is_onnx(model):  # TVM alone, the weights bound as constants
        from tvm.relax.frontend.onnx import from_onnx

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod, weights = from_onnx(_onnx_proto(model), sanitize_input_names=False), {}
    elif isinstance(model, tvm.IRModule):  # as given: none of hgrt's import or rewrites
        mod, detached = relax.frontend.detach_params(model)
        weights = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v)
                   for k, v in (params or {}).items()}
        n = len(detached.get("main", []))
        for p, v in zip(mod["main"].params[len(mod["main"].params) - n:],
                        detached.get("main", []), strict=True):
            weights.setdefault(p.name, v.numpy())
    else:  # a tvm.relax.frontend.nn module: exported as hgrt.build exports it
        from hgrt.frontend import import_model

        mod, weights = import_model(model, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = tvm.compile(mod, "llvm")
    dev = tvm.cpu()
    given = iter(inputs)
    args = [tvm.runtime.tensor(weights[p.name] if p.name in weights else next(given), dev)
            for p in mod["main"].params]
    return _flatten(relax.VirtualMachine(ex, dev)["main"](*args))


def run_lowered_vm(mod: tvm.IRModule, args: list[np.ndarray], target: Any = None
                   ) -> list[np.ndarray]:
    """An already lowered module (fused ``R.call_tir`` into PrimFuncs, as ``fused_module`` or
    ``hgrt.compiler.lower_model`` give it) on the Relax VM, its kernels compiled as they are
    (no further legalization or fusion). ``args``: ``main``'s parameters in order, inputs then
    weights. ``target``: for PrimFuncs without a ``target`` attr (default: their own)."""
    from tvm import relax

    ex = tvm.compile(mod, target, relax_pipeline=relax.pipeline.default_build_pipeline())
    dev = tvm.cpu()
    out = relax.VirtualMachine(ex, dev)["main"](*[tvm.runtime.tensor(a, dev) for a in args])
    return _flatten(out)


def _flatten(out) -> list[np.ndarray]:
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [a for o in out for a in _flatten(o)]


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


# --- running hgrt builds -----------------------------------------------------------------------


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


# --- an oracle outside hgrt: the ONNX file as onnxruntime (or ONNX's reference) runs it ---------


def _onnx_proto(model: Any):
    import onnx

    return onnx.load(model) if isinstance(model, str | os.PathLike) else model


def _onnx_feeds(proto, inputs: dict[str, np.ndarray] | list[np.ndarray]) -> dict[str, np.ndarray]:
    if isinstance(inputs, dict):
        return dict(inputs)
    inits = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in inits]
    return dict(zip(names, inputs, strict=True))


def onnx_reference(model: Any, inputs: dict[str, np.ndarray] | list[np.ndarray],
                   outputs: list[str] | None = None) -> list[np.ndarray]:
    """The oracle for ONNX models, outside hgrt and TVM: the original ``model`` (ModelProto or
    path) run by onnxruntime's CPU provider, or by ONNX's reference evaluator where onnxruntime
    is not installed. ``inputs`` by ONNX input name (or a list in graph-input order);
    ``outputs``: tensor names to return (default: the graph outputs)."""
    proto = _onnx_proto(model)
    feeds = _onnx_feeds(proto, inputs)
    if outputs:
        proto = _with_outputs(proto, outputs)
    try:
        import onnxruntime as ort
    except ImportError:
        from onnx.reference import ReferenceEvaluator

        return list(ReferenceEvaluator(proto).run(outputs, feeds))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # no pool threads left spinning beside the code under test
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return list(sess.run(outputs, feeds))


def _with_outputs(proto, names: list[str]):
    """A copy of ``proto`` whose graph outputs are the tensors ``names``."""
    import onnx
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.graph.output[:]
    out.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return out


def reference(model: Any, inputs: dict[str, np.ndarray] | list[np.ndarray],
              params: dict | None = None) -> list[np.ndarray]:
    """The oracle for what ``hgrt.build`` takes: an ONNX model (ModelProto or path) by
    ``onnx_reference``, never through hgrt's import; a Relax module by ``run_relax_vm``."""
    if _is_onnx(model):
        return onnx_reference(model, inputs)
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    return run_relax_vm(model, list(inputs), params)


def _is_onnx(model: Any) -> bool:
    return isinstance(model, str | os.PathLike) or type(model).__name__ == "ModelProto"


# --- random weights that keep the outputs informative -------------------------------------------

# ops whose output scales by s when their data input does (s > 0), so the logits stay a fixed
# multiple of the last weighted layer's output
_HOMOGENEOUS = {"Relu", "GlobalAveragePool", "AveragePool", "MaxPool", "GlobalMaxPool",
                "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Dropout", "Identity", "Transpose"}
_SOFTMAX = {"Softmax", "LogSoftmax"}
LOGITS_STD = 3.0


def _last_layer(proto) -> tuple[str, list[str]]:
    """(the logits tensor, the initializers that scale it linearly): the softmax's input (or
    the graph output when there is none), and the weight and bias of the weighted layer it
    comes from through ops that commute with a positive scale."""
    graph = proto.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}

    def weight(name: str) -> str | None:  # the initializer behind a reshaped/transposed weight
        while name not in inits:
            node = producer.get(name)
            if node is None or node.op_type not in ("Reshape", "Transpose", "Identity",
                                                    "Flatten", "Unsqueeze", "Squeeze"):
                return None
            name = node.input[0]
        return name

    head = producer.get(graph.output[0].name)
    logits = head.input[0] if head is not None and head.op_type in _SOFTMAX else \
        graph.output[0].name
    cur, scaled = logits, []
    while (node := producer.get(cur)) is not None:
        params = [w for w in map(weight, node.input[1:3]) if w is not None]
        if node.op_type in _HOMOGENEOUS:
            cur = node.input[0]
        elif node.op_type in ("Conv", "Gemm", "BatchNormalization") and weight(node.input[1]):
            return logits, scaled + params
        elif node.op_type == "MatMul" and weight(node.input[1]):
            return logits, scaled + params[:1]
        elif node.op_type == "Add" and (bias := weight(node.input[1]) or weight(node.input[0])):
            scaled.append(bias)
            cur = node.input[0] if bias == weight(node.input[1]) else node.input[1]
        else:
            break
    raise ValueError(f"no weighted layer found that scales the logits '{logits}' linearly "
                     f"(stopped at {node.op_type if node is not None else 'a graph input'} "
                     f"'{cur}')")


def calibrated(model: Any, inputs: dict[str, np.ndarray] | None = None,
               std: float = LOGITS_STD):
    """A copy of the ONNX ``model`` whose last weighted layer is scaled so that its logits (the
    input of the final softmax, or the output where there is none) have standard deviation
    ``std`` on ``inputs`` (default ``onnx_inputs``). Random weights otherwise give logits of
    hundreds, and a softmax of them is one-hot: a comparison of such outputs sees only the
    winning class."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.ModelProto()
    proto.CopyFrom(_onnx_proto(model))
    inputs = onnx_inputs(proto) if inputs is None else inputs
    logits, names = _last_layer(proto)
    now = float(np.std(onnx_reference(proto, inputs, [logits])[0]))
    if not np.isfinite(now) or now == 0:
        raise ValueError(f"logits '{logits}' have standard deviation {now}: cannot calibrate")
    scale = std / now
    for t in proto.graph.initializer:
        if t.name in names:
            value = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array((value * scale).astype(value.dtype), t.name))
    return proto


def zoo_model(name: str, seed: int = 0):
    """``hgrt.zoo.light_model(name, seed)`` calibrated (``calibrated``) on ``zoo_input``."""
    from hgrt.zoo import light_model

    model = light_model(name, seed=seed)
    return calibrated(model, zoo_input(model, seed + 1))


def zoo_input(model, seed: int = 1) -> dict[str, np.ndarray]:
    """The zoo's seeded inputs for ``model`` (``hgrt.zoo.light_input``)."""
    from hgrt.zoo import light_input

    return light_input(model, seed=seed)


def one_hot_rows(output: np.ndarray, floor: float = 1e-6) -> int:
    """How many rows of a probability ``output`` (a row per batch item, its classes flattened)
    are one-hot: the next class below ``floor`` x the largest. A comparison of such a row sees
    only its argmax."""
    rows = _rows(output)
    top2 = np.sort(rows, axis=1)[:, -2:]
    return int(np.sum(top2[:, 0] <= floor * np.abs(top2[:, 1])))


def _rows(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype="float64")
    return a.reshape(a.shape[0] if a.ndim > 1 else 1, -1)


def _is_probability(a: np.ndarray) -> bool:
    """Non-negative rows of two or more entries that each sum to 1 (a softmax's output)."""
    rows = _rows(a)
    return rows.shape[1] > 1 and bool(np.all(rows >= 0)) and \
        bool(np.allclose(rows.sum(1), 1, atol=1e-3))


def assert_close_to(got: list[np.ndarray], want: list[np.ndarray], rtol: float = 1e-4,
                    atol_of_max: float = 1e-5) -> None:
    """Each output within ``rtol`` and an absolute ``atol_of_max`` x max|want| of the oracle's,
    and no output one-hot (``one_hot_rows``) where it is a softmax, so that the comparison sees
    numbers."""
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        if _is_probability(w):
            assert one_hot_rows(w) == 0, f"the oracle's output {w.shape} is one-hot"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol_of_max * float(np.max(np.abs(w))))


def conv_model(seed: int = 0):
    """x → Conv(w, b) → Relu → Flatten → Add(f, s) → Mul(g, s) → Add(h, f): a weight (s) used by
    two ops. An ONNX ModelProto, input ``x`` of shape (1, 3, 8, 8)."""
    from onnx import TensorProto, helper, numpy_helper

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


# --- the ONNX backend test cases of the onnx wheel ---------------------------------------------


@dataclass
class OnnxCase:
    """One backend test case: its model file and test_data_set_0's inputs / expected outputs."""

    name: str
    model_path: str
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]


def _onnx_data() -> str:
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


def _read_pb(path: str) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    t = onnx.TensorProto()
    with open(path, "rb") as f:
        t.ParseFromString(f.read())
    return numpy_helper.to_array(t)


def onnx_case_names() -> list[str]:
    """Every backend case of ``CASE_DIRS`` as ``"<dir>/<case>"``, sorted per directory."""
    names = []
    for d in CASE_DIRS:
        for path in sorted(glob.glob(os.path.join(_onnx_data(), d, "*", "model.onnx"))):
            names.append(f"{d}/{os.path.basename(os.path.dirname(path))}")
    return names


def load_case(name: str) -> OnnxCase:
    """The backend case ``name`` (e.g. ``"pytorch-converted/test_Conv2d"``)."""
    root = os.path.join(_onnx_data(), name)
    data = os.path.join(root, "test_data_set_0")

    def arrays(kind: str) -> list[np.ndarray]:
        paths = glob.glob(os.path.join(data, f"{kind}_*.pb"))
        return [_read_pb(p) for p in sorted(paths, key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]

    return OnnxCase(name, os.path.join(root, "model.onnx"), arrays("input"), arrays("output"))


def case_inputs(case: OnnxCase) -> dict[str, np.ndarray]:
    """The case's input arrays keyed by hgrt input name (initializers listed as inputs dropped)."""
    import onnx

    graph = onnx.load(case.model_path).graph
    inits = {t.name for t in graph.initializer}
    given = [a for i, a in zip(graph.input, case.inputs, strict=False) if i.name not in inits]
    return dict(zip(input_names(case.model_path), given, strict=True))


def check_case(case: OnnxCase, placement: str, form: str = "onnx") -> None:
    """Build ``case`` (placement ``"single"``: all on cpu:0, or ``"alternating"``: ops alternate
    between cpu:0 and cpu:1), run it and compare with the expected outputs. ``form``:
    ``"onnx"`` builds the file; ``"relax"`` the Relax module TVM's ``from_onnx`` makes of it
    with the weights bound as constants (as a TVM user hands it over)."""
    model: Any = case.model_path
    if form == "relax":
        import onnx
        from tvm.relax.frontend.onnx import from_onnx

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = from_onnx(onnx.load(case.model_path), sanitize_input_names=False)
        except Exception as e:
            raise hgrt.BuildError(f"the ONNX frontend cannot import this model: {e}") from e
    if placement == "single":
        res = hgrt.build(model, ["cpu:0"])
    else:
        res = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
    inputs = case_inputs(case)
    if form == "relax":
        main = model["main"]
        inputs = dict(zip([p.name for p in main.params[:int(main.attrs["num_input"])]],
                          inputs.values(), strict=True))
    got = run_hgrt(res, inputs)
    assert len(got) == len(case.outputs)
    for g, want in zip(got, case.outputs, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4)


# --- the runtime alone: hand-made kernels and graph JSON ---------------------------------------


def add_one_chain(n: int, steps: int) -> GraphBuilder:
    """x -> ``steps`` add_one kernels on (n,) float32 tensors, alternating two storages."""
    g = GraphBuilder(shape=(n,))
    a = g.input("x", sid=0)
    for i in range(steps):
        a = g.op("add_one", [a], sids=[1 + i % 2])
    g.output(a)
    return g

@functools.cache
def elementwise_lib(n: int = N, dtype: str = "float32") -> tvm.runtime.Module:
    """A library with add_one, add, mul, twice_out (a+1, a*2) and add_one_2d (on (4, n/4))."""
    from tvm import te

    one, two = tvm.tirx.const(1, dtype), tvm.tirx.const(2, dtype)
    a = te.placeholder((n,), dtype, name="a")
    b = te.placeholder((n,), dtype, name="b")
    funcs = {
        "add_one": [a, te.compute((n,), lambda i: a[i] + one, name="o")],
        "add": [a, b, te.compute((n,), lambda i: a[i] + b[i], name="o")],
        "mul": [a, b, te.compute((n,), lambda i: a[i] * b[i], name="o")],
        "twice_out": [a, te.compute((n,), lambda i: a[i] + one, name="o1"),
                      te.compute((n,), lambda i: a[i] * two, name="o2")],
    }
    a2 = te.placeholder((4, n // 4), dtype, name="a2")
    funcs["add_one_2d"] = [a2, te.compute((4, n // 4), lambda i, j: a2[i, j] + one)]
    mod = tvm.IRModule({name: te.create_prim_func(args).with_attr("global_symbol", name)
                        for name, args in funcs.items()})
    return tvm.tirx.build(mod, target="llvm")


class GraphBuilder:
    """Builds classic graph JSON by hand: ``x = g.input("x", dev=0); y = g.op("add_one", [x], 1)``.

    Entries are referred to as (node_id, index). By default every entry has its own storage id.
    """

    def __init__(self, shape=(N,), dtype="float32"):
        self.shape, self.dtype = tuple(shape), dtype
        self.nodes, self.shapes, self.dtypes, self.devs, self.sids = [], [], [], [], []
        self.arg_nodes, self.heads, self.params = [], [], []

    def _add(self, node, n_out, dev, sids, shapes):
        nid = len(self.nodes)
        self.nodes.append(node)
        for k in range(n_out):
            self.shapes.append(list(shapes[k] if shapes else self.shape))
            self.dtypes.append(self.dtype)
            self.devs.append(dev)
            self.sids.append(sids[k] if sids else len(self.sids))
        return [(nid, k) for k in range(n_out)]

    def input(self, name, dev=0, sid=None, shape=None, param=False):
        self.arg_nodes.append(len(self.nodes))
        if param:
            self.params.append(name)
        return self._add({"op": "null", "name": name, "inputs": []}, 1, dev,
                         [sid] if sid is not None else None, [shape] if shape else None)[0]

    def op(self, func, inputs, dev=0, num_outputs=1, sids=None, name=None, flatten=False,
           shapes=None):
        node = {"op": "tvm_op", "name": name or f"{func}_{len(self.nodes)}",
                "inputs": [[nid, k, 0] for nid, k in inputs],
                "attrs": {"func_name": func, "num_inputs": str(len(inputs)),
                          "num_outputs": str(num_outputs), "flatten_data": "1" if flatten else "0"}}
        outs = self._add(node, num_outputs, dev, sids, shapes)
        return outs[0] if num_outputs == 1 else outs

    def copy(self, x, dev, sid=None):
        return self.op("__copy", [x], dev, sids=[sid] if sid is not None else None,
                       name=f"copy_{len(self.nodes)}", shapes=[self.shapes[self._eid(x)]])

    def _eid(self, ref):
        nid, k = ref
        return sum(int(n.get("attrs", {}).get("num_outputs", 1)) for n in self.nodes[:nid]) + k

    def output(self, *refs):
        self.heads.extend([[nid, k, 0] for nid, k in refs])

    def doc(self, device_column=True, pools=False):
        row_ptr = [0]
        for n in self.nodes:
            row_ptr.append(row_ptr[-1] + int(n.get("attrs", {}).get("num_outputs", 1)))
        attrs = {"shape": ["list_shape", self.shapes], "dltype": ["list_str", self.dtypes],
                 "storage_id": ["list_int", self.sids]}
        if device_column:
            attrs["device_index"] = ["list_int", self.devs]
        doc = {"nodes": self.nodes, "arg_nodes": self.arg_nodes, "node_row_ptr": row_ptr,
               "heads": self.heads, "attrs": attrs, "hgrt": {"version": 1, "params": self.params}}
        if pools:
            doc["hgrt"].update(self._pool_plan())
        return json.loads(json.dumps(doc))

    def json(self, **kw):
        return json.dumps(self.doc(**kw))

    def _pool_plan(self):
        """Pack storage ids into one arena per device, in order (no reuse across sids)."""
        size, dev_of = {}, {}
        for eid, sid in enumerate(self.sids):
            nbytes = int(np.prod(self.shapes[eid])) * np.dtype(self.dtype).itemsize
            size[sid] = max(size.get(sid, 0), nbytes)
            dev_of[sid] = self.devs[eid]
        n_dev = max(self.devs) + 1
        pool, offsets = [0] * n_dev, [0] * (max(self.sids) + 1)
        for sid in sorted(size):
            offsets[sid] = pool[dev_of[sid]]
            pool[dev_of[sid]] += (size[sid] + 63) // 64 * 64
        return {"pool_bytes": pool, "storage_offset": offsets}
