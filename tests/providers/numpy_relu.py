"""A kernel provider in a few lines, registered by the recipe of docs/architecture.md ("Adding
a kernel provider"): numpy computes every float32 ReLU on a CPU device. Its claim pass and its
runtime live in this one module; ``PROVIDER`` is its declaration."""

from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from hgrt.providers import KernelProvider
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import bindings, op_name

PROVIDER = KernelProvider(
    name="numpy", func_prefix="test.numpy.", title="numpy", runtime=__name__,
    passes=(("claim", f"{__name__}:claim_numpy"),), op_attr="numpy_op")
RELU = PROVIDER.func_prefix + "relu"
calls = [0]  # kernels run, for the tests


def _on_cpu(var: relax.Var) -> bool:
    vdev = var.ty.vdevice
    return vdev is None or str(vdev.target.kind.name) == "llvm"


@contract(reads={"options", "placed"}, writes={"placed"}, after=("insert_copies",),
          before=("fold_batch_norm",))
def claim_numpy(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Every float32 ReLU on a CPU that ``kernels`` gives to numpy (or to "auto") becomes a
    call of ``test.numpy.relu``."""
    kernels, func = Kernels.of(ctx.options.kernels), mod["main"]
    extern = relax.ExternFunc(RELU).with_attr("provider", PROVIDER.name) \
        .with_attr("numpy_op", "relu")
    taken = {}
    for b in bindings(func):
        if op_name(b.value) == "relax.nn.relu" and b.var.ty.dtype == "float32" \
                and _on_cpu(b.var) and kernels.choice(b.var.name, "nn.relu")[0] == PROVIDER.name:
            taken[b.var] = relax.op.call_dps_packed(extern, relax.Tuple([b.value.args[0]]),
                                                    b.var.ty)
    if not taken:
        return mod
    blocks = [type(block)([relax.VarBinding(b.var, taken[b.var]) if b.var in taken else b
                           for b in block.bindings]) for block in func.body.blocks]
    for row in ctx.placed.report:
        if any(row.node == v.name for v in taken):
            row.kernels = PROVIDER.name
    new = mod.clone()
    new.update_func(new.get_global_var("main"), relax.Function(
        func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
        func.attrs))
    return new


def _relu(x, out) -> None:
    calls[0] += 1
    np.maximum(np.from_dlpack(x), 0, out=np.from_dlpack(out))


def load() -> None:
    tvm_ffi.register_global_func(RELU, _relu, override=True)


def unavailable_reason() -> None:
    return None


def forget(ranges) -> None:
    pass
