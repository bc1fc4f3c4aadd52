"""hgrt's compiler passes, written on Relax (Relay's successor): each is ``pass(ir, ctx) -> ir``
with a declared ``Contract`` (what it reads and writes of the context, which passes it needs
before it); ``hgrt.compiler.PASSES`` runs them in order, from place_devices to plan_memory."""

from hgrt.devices import DeviceSpec, parse_devices
from hgrt.relay_passes.context import BuildContext, PlacementRow
from hgrt.relay_passes.graph_codegen import graph_codegen
from hgrt.relay_passes.insert_copies import insert_copies
from hgrt.relay_passes.lower import assign_targets, build_library, legalize_and_fuse, schedule_gpu
from hgrt.relay_passes.pipeline import Contract, check_order, contract, run_passes
from hgrt.relay_passes.place_devices import Placement, place_devices
from hgrt.relay_passes.plan_memory import plan_memory, verify_memory
from hgrt.relay_passes.schedule_cpu import schedule_cpu
from hgrt.relay_passes.tuning_db import apply_tuning

__all__ = [
    "BuildContext", "Contract", "DeviceSpec", "Placement", "PlacementRow", "apply_tuning",
    "assign_targets", "build_library", "check_order", "contract", "graph_codegen",
    "insert_copies", "legalize_and_fuse", "parse_devices", "place_devices", "plan_memory",
    "run_passes", "schedule_cpu", "schedule_gpu", "verify_memory",
]
