"""Helpers for the kernel-quality tests: light zoo models of the onnx wheel with seeded random
weights (the files hold ConstantOfShape placeholders), fused the way ``lower`` fuses them."""

from __future__ import annotations

import os

import numpy as np
import tvm
from tvm import relax

LIGHT = os.path.join(os.path.dirname(__import__("onnx").__file__), "backend", "test", "data",
                     "light")


def light_model(name: str, seed: int = 0):
    """``light_<name>.onnx`` with every ConstantOfShape weight replaced by a random initializer
    (He-scaled normal for ≥2-D tensors, uniform [0.5, 1.5) for 1-D: biases, BN scale/variance)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(os.path.join(LIGHT, f"light_{name}.onnx"))
    rng = np.random.default_rng(seed)
    inits = {i.name: i for i in m.graph.initializer}
    keep = []
    for n in m.graph.node:
        if n.op_type == "ConstantOfShape" and n.input[0] in inits:
            shape = numpy_helper.to_array(inits[n.input[0]]).astype(int)
            if len(shape) > 1:
                fan = int(np.prod(shape[1:]))
                w = rng.standard_normal(shape) * np.sqrt(2.0 / max(fan, 1))
            else:
                w = rng.uniform(0.5, 1.5, shape)
            m.graph.initializer.append(numpy_helper.from_array(w.astype(np.float32), n.output[0]))
        else:
            keep.append(n)
    del m.graph.node[:]
    m.graph.node.extend(keep)
    used = {i for n in keep for i in n.input}
    for name_ in list(inits):
        if name_ not in used:
            m.graph.initializer.remove(inits[name_])
    names = {i.name for i in m.graph.initializer}
    ins = [i for i in m.graph.input if i.name in used and i.name not in names]
    del m.graph.input[:]
    m.graph.input.extend(ins)
    return m


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
