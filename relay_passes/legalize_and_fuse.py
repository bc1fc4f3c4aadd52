"""legalize_and_fuse: Relax ops → ``R.call_tir`` into fused PrimFuncs.

TVM does the work (``lowering_passes``); fusion never crosses devices because every crossing
edge is an ``R.to_vdevice`` (not a call_tir). A failure names the op it fails on alone.
"""

from __future__ import annotations

import tvm
from tvm import relax

from hgrt.relay_passes.inner.cpu_schedule_math import vector_math_legalizations
from hgrt.relay_passes.inner.lowering_rewrites import (
    keep_device_joins_apart,
    powers_as_products,
    reshape_outputs_as_views,
    rewrite_dataflow_reshape,
)
from hgrt.relay_passes.inner.slice_views import slice_views
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract, located
from hgrt.relay_passes.util.reasons import aliases, fused_members, kernel_reasons
from hgrt.relay_passes.util.relax_util import (
    TO_VDEVICE,
    alone,
    bindings,
    op_name,
    site,
)


def lowering_passes() -> list[tvm.transform.Pass]:
    """TVM's passes that legalize and fuse a placed module (what ``legalize_and_fuse`` runs)."""
    return [
        # inference batch_norm (one fold_batch_norm left: statistics not weights) →
        # elementwise ops that fuse into the convolution before it
        relax.transform.DecomposeOpsForInference("main"),
        relax.transform.CanonicalizeBindings(),  # (y, mean, var)[0] → y: relu may fuse too
        # reshape(reshape(x, a), b) -> reshape(x, b): two reshapes in a row fuse into one
        # copying kernel that RewriteDataflowReshape does not see as a view (squeezenet's
        # mean, kept N,C,1,1, then flattened: 28 us a run for 4 KB); one becomes a view
        relax.transform.RemoveRedundantReshape(),
        relax.transform.DeadCodeElimination(["main"]),
        # cumsum, sort, topk, bucketize: LegalizeOps has no rule for them (RoBERTa's
        # position ids are a cumsum of the input mask)
        relax.backend.DispatchSortScan(),
        # exp/erf/tanh of float32 CPU kernels as arithmetic that vectorizes, not libm calls
        # (``cpu_schedule_math``; ``HGRT_LIBM=1`` keeps libm)
        relax.transform.LegalizeOps(vector_math_legalizations()),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        keep_device_joins_apart,
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        relax.transform.AnnotateTIROpPattern(),  # the fused kernels' kinds: graph "op_pattern"
        relax.transform.DeadCodeElimination(["main"]),
        rewrite_dataflow_reshape,  # reshape kernels → views (graph "__nop")
        reshape_outputs_as_views,
        # the kernels that became views (here and above): not built, not counted as untuned
        # by a tuning report (resnet50's flatten)
        relax.transform.DeadCodeElimination(["main"]),
    ]


# after the passes that rewrite Relax ops (they match the ops lowering replaces; a kernel
# provider's claim passes say ``before=("legalize_and_fuse",)``) and after insert_copies, whose
# R.to_vdevice on every crossing edge keeps fusion within a device
# (reads the placement report and kernels to say why each kernel runs where and by whom)
@contract(reads={"devices", "weights", "placed", "options"}, writes={"lowered"},
          after=("insert_copies", "split_concat", "fold_batch_norm"))
def legalize_and_fuse(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """``lowering_passes`` under the first device's target; a failure names the op it fails
    on. ``ctx.lowered.slices``: the copy kernels graph_codegen writes as views
    (``inner.slice_views``). ``ctx.lowered.why``: each kernel's reasons (``util.reasons``)."""
    mod = powers_as_products(mod, ctx)  # (an exponent's value: a weight of ctx's)
    members: dict[relax.Var, list[str]] = {}
    with located(lambda: _failing_op(mod, ctx)):
        lowered = _lowered(mod, ctx, members)
    ctx.lowered.slices = slice_views(lowered, ctx)
    ctx.lowered.why = kernel_reasons(lowered, ctx, members, aliases(mod["main"]))
    return lowered


def _lowered(mod: tvm.IRModule, ctx: BuildContext,
             members: dict[relax.Var, list[str]] | None = None) -> tvm.IRModule:
    """``mod`` lowered; ``members`` gets what each call after FuseOps computes."""
    with ctx.devices[0].target, tvm.transform.PassContext(opt_level=3):
        for p in lowering_passes():
            before, mod = mod, p(mod)
            if members is not None and p.info.name == "FuseOps":
                members.update(fused_members(before["main"], mod))
    return mod


def _failing_op(mod: tvm.IRModule, ctx: BuildContext) -> str:
    """The first op binding of ``main`` that lowering fails on alone."""
    for b in bindings(mod["main"]):
        if op_name(b.value) in (None, TO_VDEVICE):
            continue
        try:
            _lowered(alone(b.value, mod), ctx)
        except Exception:
            return site(b, ctx, ctx.device_of_vdevice(getattr(b.var.ty, "vdevice", None)))
    return "no op fails alone (a fusion of several does)"
