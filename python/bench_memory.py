"""Memory planned by hgrt vs the lower bound and the Relax VM, per light zoo model and device.

    python python/bench_memory.py [model ...]

hgrt's figure is its whole arena (inputs, params, intermediates, outputs). The Relax VM's is
what it allocates for the same run: the storages StaticPlanBlockMemory plans, the tensors it
leaves unplanned (outputs), plus inputs and params (function arguments).
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import tvm
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.lifetimes import align
from hgrt.testing import alternating
from hgrt.zoo import LIGHT_MODELS, light_model


def _nbytes(ty) -> int:
    """Bytes of a tensor type, rounded up to 64 as TVM's CPU allocator aligns every buffer
    (and as hgrt's plan counts them), so that tiny tensors are compared like for like."""
    elems = int(np.prod([int(d) for d in ty.shape.values]))
    return align(elems * tvm.runtime.DataType(ty.dtype).bits // 8)


def vm_planned_bytes(model) -> int:
    mod, params = import_model(model)
    target = tvm.target.Target("llvm")
    seq = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["main"]), relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(), relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory()])
    with target, tvm.transform.PassContext(opt_level=3):
        mod = seq(mod)
    total = sum(_nbytes(p.ty) for p in mod["main"].params)
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            name = getattr(getattr(v, "op", None), "name", "")
            if name == "relax.memory.alloc_storage":
                total += align(int(v.args[0].values[0]))
            elif name == "relax.builtin.alloc_tensor":
                total += _nbytes(b.var.ty)
    return total


def main(models: list[str]) -> None:
    print(f"{'model':14} {'build':12} {'dev':>3} {'planned MB':>10} {'/bound':>7} {'/VM':>6}")
    for name in models:
        model = light_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vm = vm_planned_bytes(model)
            single = hgrt.build(model, ["cpu:0"])
            split = hgrt.build(model, ["cpu:0", "cpu:1"], alternating(model))
        for label, res in (("cpu:0", single), ("alternating", split)):
            for m in res.memory_report:
                ratio_vm = f"{m.planned_bytes / vm:6.3f}" if label == "cpu:0" else "     -"
                print(f"{name:14} {label:12} {m.device:>3} {m.planned_bytes / 2**20:10.2f} "
                      f"{m.planned_bytes / max(m.lower_bound, 1):7.3f} {ratio_vm}")
        print(f"{name:14} {'Relax VM':12} {'':>3} {vm / 2**20:10.2f}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(LIGHT_MODELS))
