"""schedule_gpu: GPU PrimFuncs scheduled with dlight; one left unscheduled is a ``BuildError``
naming it (a CUDA PrimFunc without a schedule would build into host code without a word), and
so is one that says no GPU can schedule it (``NO_GPU_SCHEDULE_ATTR``: placement puts those on
a CPU unless a hint, an override or a rule naming the op puts them on the GPU).
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
    no_gpu_schedule,
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
    refused = [f"{kernel_site(mod, ctx, n)}: {why}" for n, f in sorted(gpu.items())
               if (why := no_gpu_schedule(f)) is not None]
    if refused:
        raise BuildError(f"placed on a GPU but no GPU can schedule them: {refused}; place these "
                         f"ops on a CPU device (drop the hint, override or rule that puts them "
                         f"on the GPU)")
    ctx.log(f"scheduling {len(gpu)} GPU functions with dlight")
    new = mod.clone()
    by_target: dict[str, dict] = {}
    for name, f in gpu.items():
        by_target.setdefault(str(f.attrs["target"]), {})[name] = f
    chain = (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
             dl.gpu.Fallback())
    rules = dl.ApplyDefaultSchedule(*chain)
    for funcs in by_target.values():
        target = next(iter(funcs.values())).attrs["target"]
        try:
            with target:
                sub = rules(tvm.IRModule(funcs))
        except Exception:  # noqa: BLE001 - a rule that fails on one function: one at a time
            sub = _one_by_one(funcs, chain, target, mod, ctx)
        for gv, f in sub.functions_items():
            new.update_func(new.get_global_var(gv.name_hint), f)
    unscheduled = [kernel_site(mod, ctx, n) for n in sorted(gpu) if not is_scheduled(new[n])]
    if unscheduled:
        raise BuildError(f"GPU PrimFuncs left unscheduled by dlight: {unscheduled}; place "
                         f"these ops on a CPU device (Placement.rules / overrides)")
    return new


def _one_by_one(funcs: dict, chain: tuple, target, mod: tvm.IRModule,
                ctx: BuildContext) -> tvm.IRModule:
    """``funcs`` scheduled one by one: a function on which a dlight rule raises (GEMV's asserts
    on a depthwise convolution with a clip, TVM 0.27) takes the first of the later rules that
    schedules it, said in the log; the error of the whole chain where none does."""
    import tvm.s_tir.dlight as dl

    out = {}
    for name, f in funcs.items():
        one = tvm.IRModule({name: f})
        try:
            with target:
                out[name] = dl.ApplyDefaultSchedule(*chain)(one)[name]
            continue
        except Exception:  # noqa: BLE001 - the rules one by one below
            pass
        for i, rule in enumerate(chain):
            try:
                with target:
                    got = dl.ApplyDefaultSchedule(rule)(one)[name]
            except Exception:  # noqa: BLE001 - the next rule
                continue
            if is_scheduled(got):
                ctx.log(f"{name}: scheduled by dlight's {type(rule).__name__} (the rules before "
                        f"it failed on it)" if i else f"{name}: scheduled one by one")
                out[name] = got
                break
        else:
            rules = dl.ApplyDefaultSchedule(*chain)
            with target, located(functools.partial(failing_kernel, mod, ctx, {name: f}, rules)):
                rules(one)
            out[name] = f
    return tvm.IRModule(out)
