"""schedule_cpu: a cheap default schedule for every CPU PrimFunc that MetaSchedule did not tune
(``inner/cpu_schedule.py`` says how it schedules), and the weights its tiles read in another
layout prepacked once (``inner/prepack_weights.py``)."""

from __future__ import annotations

import os

import tvm

from hgrt.relay_passes.inner.cpu_schedule import (
    ScheduleReport,
    default_schedule_trace,
    schedule_cpu_functions,
)
from hgrt.relay_passes.inner.prepack_weights import prepack, weight_params
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract

__all__ = ["ScheduleReport", "default_schedule_trace", "schedule_cpu", "schedule_cpu_functions"]


# CPU kernels are known by their target; the tuned ones are scheduled already
@contract(reads={"weights"}, writes={"lowered", "weights"},
          after=("assign_targets", "apply_tuning"))
def schedule_cpu(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """The default schedule for every CPU kernel not scheduled yet (none with
    ``HGRT_DEFAULT_SCHEDULE=0``), its report in ``ctx.lowered.cpu_schedule``; the weights it
    reads in another layout are prepacked (new weights)."""
    if os.environ.get("HGRT_DEFAULT_SCHEDULE", "1") == "0":
        return mod
    mod, report = schedule_cpu_functions(mod, weights=weight_params(mod, ctx))
    ctx.lowered.cpu_schedule = report
    ctx.log(report.summary())
    return prepack(mod, ctx, report.prepacked)
