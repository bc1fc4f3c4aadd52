"""Helpers for the kernel-quality tests: light zoo models of the onnx wheel with seeded random
weights (the files hold ConstantOfShape placeholders), fused the way ``lower`` fuses them."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from hgrt.zoo import light_model  # noqa: F401 - re-exported


def input_shape(model) -> list[int]:
    return [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]


def fused_module(model) -> tuple[tvm.IRModule, list[np.ndarray]]:
    """ONNX model → (fused IRModule, weights in ``main``'s parameter order)."""
    from tvm.relax.frontend.onnx import from_onnx

    mod = from_onnx(model, keep_params_in_input=True)
    mod, params = relax.frontend.detach_params(mod)
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["main"])])
    with tvm.target.Target("llvm"), tvm.transform.PassContext(opt_level=3):
        mod = seq(mod)
    return mod, [p.numpy() for p in params.get("main", [])]


def run_relax_vm(mod: tvm.IRModule, target, args: list[np.ndarray]) -> np.ndarray:
    ex = tvm.compile(mod, target)
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    out = vm["main"](*[tvm.runtime.tensor(a, dev) for a in args])
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()
