"""schedule_gpu: GPU PrimFuncs scheduled with dlight; one left unscheduled is a ``BuildError``
naming it (a CUDA PrimFunc without a schedule would build into host code without a word).
"""

from __future__ import annotations

import functools

import tvm

from hgrt.errors import BuildError
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.lowered import failing_kernel, kernel_site
from hgrt.relay_passes.util.pipeline import contract, located
from hgrt.relay_passes.util.relax_util import (
    func_target,
    is_scheduled,
    prim_funcs,
)


# GPU functions are known by their target; the tuned ones are scheduled already
@contract(after=("assign_targets", "apply_tuning"))
def schedule_gpu(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """dlight-schedule every GPU PrimFunc not scheduled yet; refuse one that stays unscheduled.
    Uses nothing of ``ctx`` but its log."""
    import tvm.s_tir.dlight as dl

    gpu = {name: f for name, f in prim_funcs(mod).items()
           if func_target(f) is not None and f.attrs["target"].kind.name not in ("llvm", "c")}
    if not gpu:
        return mod
    ctx.log(f"scheduling {len(gpu)} GPU functions with dlight")
    new = mod.clone()
    by_target: dict[str, dict] = {}
    for name, f in gpu.items():
        by_target.setdefault(str(f.attrs["target"]), {})[name] = f
    rules = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())
    for funcs in by_target.values():
        with next(iter(funcs.values())).attrs["target"], located(
                functools.partial(failing_kernel, mod, ctx, funcs, rules)):
            sub = rules(tvm.IRModule(funcs))
        for gv, f in sub.functions_items():
            new.update_func(new.get_global_var(gv.name_hint), f)
    unscheduled = [kernel_site(mod, ctx, n) for n in sorted(gpu) if not is_scheduled(new[n])]
    if unscheduled:
        raise BuildError(f"GPU PrimFuncs left unscheduled by dlight: {unscheduled}; place "
                         f"these ops on a CPU device (Placement.rules / overrides)")
    return new
