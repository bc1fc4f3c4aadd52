"""The oracles, outside hgrt, and how to compare with them: ``reference`` runs an ONNX file on
onnxruntime (or ONNX's reference evaluator), never through hgrt's import (``onnx_reference``),
and a Relax module through ``tvm.compile`` + the Relax VM (``run_relax_vm``); ``run_lowered_vm``
runs an already lowered (fused) module. ``assert_close_to`` compares outputs with the oracle's
and refuses a one-hot softmax (``one_hot_rows``), whose comparison would see only its argmax.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import tvm


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
            mod, weights = from_onnx(onnx_proto(model), sanitize_input_names=False), {}
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


def onnx_proto(model: Any):
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
    proto = onnx_proto(model)
    feeds = _onnx_feeds(proto, inputs)
    if outputs:
        proto = _with_outputs(proto, outputs)
    from onnx.reference import ReferenceEvaluator

    try:
        import onnxruntime as ort
    except ImportError:
        return list(ReferenceEvaluator(proto).run(outputs, feeds))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # no pool threads left spinning beside the code under test
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
    except Exception as e:  # an onnxruntime older than the onnx package that wrote the model
        if "Unsupported model IR version" not in str(e):
            raise
        return list(ReferenceEvaluator(proto).run(outputs, feeds))
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
