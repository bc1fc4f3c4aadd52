"""hgrt's compiler passes, written on Relax (Relay's successor): each is ``pass(ir, ctx) -> ir``.

place_devices → insert_copies → lower (+ build_library) → graph_codegen → plan_memory.
"""

from hgrt.relay_passes.context import BuildContext, DeviceSpec, PlacementRow, parse_devices
from hgrt.relay_passes.graph_codegen import graph_codegen
from hgrt.relay_passes.insert_copies import insert_copies
from hgrt.relay_passes.lower import build_library, lower
from hgrt.relay_passes.pipeline import run_passes
from hgrt.relay_passes.place_devices import Placement, place_devices
from hgrt.relay_passes.plan_memory import memory_report, plan_memory, verify_memory

__all__ = [
    "BuildContext", "DeviceSpec", "Placement", "PlacementRow", "build_library", "graph_codegen",
    "insert_copies", "lower", "memory_report", "parse_devices", "place_devices", "plan_memory",
    "run_passes", "verify_memory",
]
