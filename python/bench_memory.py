"""Memory planned by hgrt vs the lower bound and the Relax VM, per light zoo model and device.

    python python/bench_memory.py [model ...]
    python python/bench_memory.py --kernels [model ...]
    python python/bench_memory.py --kernels resnet.dynamo vit.dynamo   # corpus, real size

With ``--kernels``: per model, the planned bytes of every device (weights and activations) of
the default build (oneDNN, Winograd within ``claim_onednn.WINOGRAD_SHARE`` of the weights), of
the same build with every Winograd convolution (``winograd=True``) and without any, each
against the build on TVM's kernels.

hgrt's figure is its whole arena (inputs, params, intermediates, outputs). The Relax VM's is
what it allocates for the same run: the storages StaticPlanBlockMemory plans, the tensors it
leaves unplanned (outputs), plus inputs and params (function arguments).
"""

from __future__ import annotations

import hgrt.spin  # noqa: F401  (first: the spin settings before TVM loads libgomp)

# isort: split
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


def _model(name: str):
    """A light zoo model by name, or a corpus file at its real size (``<model>.<exporter>``,
    exported on demand into the corpus cache: the corpus extra)."""
    if "." not in name:
        return light_model(name)
    import onnx

    from hgrt.corpus.generate import real_path

    model, exporter = name.split(".", 1)
    return onnx.load(real_path(model, exporter))


def main(models: list[str]) -> None:
    print(f"{'model':14} {'build':12} {'dev':>3} {'planned MB':>10} {'/bound':>7} {'/VM':>6}")
    for name in models:
        model = _model(name)
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


def kernels_table(models: list[str]) -> None:
    from hgrt.relay_passes.util.kernels import Kernels

    def planned(res) -> int:
        return sum(m.planned_bytes for m in res.memory_report)

    print(f"{'model':24} {'tvm MiB':>8} {'default MiB':>12} {'/tvm':>6} {'all Winograd':>13} "
          f"{'/tvm':>6} {'no Winograd':>12} {'/tvm':>6}")
    for name in models:
        model = _model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tvm_b = planned(hgrt.build(model, ["cpu"], kernels="tvm"))
            row = [planned(hgrt.build(model, ["cpu"], kernels=k)) for k in
                   ("auto", Kernels("auto", winograd=True), Kernels("auto", winograd=False))]
        print(f"{name:24} {tvm_b / 2**20:8.1f} " + " ".join(
            f"{b / 2**20:{w}.1f} {b / tvm_b:6.2f}" for b, w in zip(row, (12, 13, 12),
                                                                  strict=True)), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--kernels"]:
        kernels_table(args[1:] or list(LIGHT_MODELS))
    else:
        main(args or list(LIGHT_MODELS))
