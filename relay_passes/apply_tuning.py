"""apply_tuning: the schedules ``hgrt tune`` wrote to a database (``inner/tuning_db.py``), put
back into the fused module before the default schedules fill in the rest."""

from __future__ import annotations

import tvm

from hgrt.relay_passes.inner.tuning_db import apply_database
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import contract


# records match by structural hash and target: the kernels as fused, with their targets
@contract(reads={"options"}, writes={"lowered"}, after=("assign_targets",))
def apply_tuning(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """The tuned schedules of ``ctx.options.tuning_db`` (none given: ``mod`` untouched);
    ``ctx.lowered.tuning`` says which (the ``ApplyReport``)."""
    if not ctx.options.tuning_db:
        return mod
    mod, ctx.lowered.tuning = apply_database(mod, ctx.options.tuning_db, log=ctx.log,
                                             use_verdicts=ctx.options.tuning_verdicts,
                                             explicit=True)
    return mod
