"""Model import: ONNX (ModelProto or path) or a Relax IRModule → (IRModule, params), with the
stacked reductions of TVM's ONNX import made pairwise and computations on weights alone done
once, here (``relay_passes/simplify.py``).

Params are always detached: ``main`` takes the user inputs first (``num_input`` of them), then
the weights, which come back as numpy arrays keyed by param name, so no weight is baked into
the compiled library.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.errors import BuildError
from hgrt.relay_passes.simplify import fold_weight_transforms, pairwise_reductions


def _from_onnx(model: Any, input_shapes: dict[str, Any] | None) -> tuple[tvm.IRModule, dict]:
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    if isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model))
    inits = {t.name for t in model.graph.initializer}
    if any(i.name in inits for i in model.graph.input):
        # old exporters list initializers as inputs too; TVM's frontend then makes each weight
        # two params, so keep only the true inputs
        model, original = type(model)(), model
        model.CopyFrom(original)
        kept = [i for i in model.graph.input if i.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(kept)
    shape_dict = {k: list(v) for k, v in (input_shapes or {}).items()}
    try:
        mod = from_onnx(model, shape_dict=shape_dict or None, keep_params_in_input=True)
    except Exception as e:
        raise BuildError(f"the ONNX frontend cannot import this model: {e}") from e
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"]) if "num_input" in main.attrs else len(main.params)
    names = [p.name for p in main.params[num_input:]]
    return mod, {n: v.numpy() for n, v in zip(names, detached.get("main", []), strict=True)}


def _from_relax(mod: tvm.IRModule, params: dict[str, Any] | None) -> tuple[tvm.IRModule, dict]:
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise BuildError("the Relax IRModule has no 'main' function")
    mod, detached = relax.frontend.detach_params(mod)
    main = mod["main"]
    given = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v)
             for k, v in (params or {}).items()}
    if detached.get("main"):
        n = len(detached["main"])
        for p, v in zip(main.params[len(main.params) - n:], detached["main"], strict=True):
            given.setdefault(p.name, v.numpy())
    names = [p.name for p in main.params]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise BuildError(f"params {unknown} are not parameters of main (it takes {names})")
    # weights must come after the user inputs: reorder main's params if needed
    inputs = [p for p in main.params if p.name not in given]
    weights = [p for p in main.params if p.name in given]
    if list(main.params) != inputs + weights:
        main = relax.Function(inputs + weights, main.body, main.ret_ty, main.is_pure, main.attrs)
    main = main.with_attr("num_input", len(inputs))
    mod = mod.clone()
    mod.update_func(mod.get_global_var("main"), main)
    return mod, given


def import_model(model: Any, params: dict[str, Any] | None = None,
                 input_shapes: dict[str, Any] | None = None
                 ) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import ``model`` (onnx ModelProto, path to a .onnx file, or Relax IRModule).

    >>> mod, params = import_model("model.onnx")  # doctest: +SKIP
    >>> mod["main"].attrs["num_input"], sorted(params)[:2]  # doctest: +SKIP
    """
    if isinstance(model, tvm.IRModule):
        if input_shapes:
            raise BuildError("input_shapes applies to ONNX models; a Relax IRModule carries its "
                             "own shapes")
        mod, weights = _from_relax(model, params)
    elif isinstance(model, (str, os.PathLike)) or type(model).__name__ == "ModelProto":
        if params:
            raise BuildError("params are read from the ONNX model; do not pass them separately")
        mod, weights = _from_onnx(model, input_shapes)
    else:
        raise BuildError(f"cannot import a {type(model).__name__}: give an onnx ModelProto, a "
                         f"path to an .onnx file or a Relax IRModule")
    return fold_weight_transforms(pairwise_reductions(mod), weights)
