"""hgrt's compiler passes, written on Relax (Relay's successor): each is ``pass(ir, ctx) -> ir``
with a declared ``Contract`` (what it reads and writes of the context, which passes it needs
before it); ``hgrt.compiler.PASSES`` runs them in order, from place_devices to plan_memory.

The folder shows the four kinds of file (``tests/test_architecture.py`` keeps it so):

- ``relay_passes/*.py``: the pipeline passes on Relax, one per file, each named after its pass
  (``place_devices.py`` … ``build_library.py``, ``graph_codegen.py``: Relax → Graph);
- ``relay_passes/graph/``: the pipeline passes on the graph after codegen (``concat_views``,
  ``assign_streams``, ``plan_memory``), one per file, named likewise;
- ``relay_passes/inner/``: passes that other passes call, in no pipeline of their own
  (``auto_place``, ``lowering_rewrites``, the default CPU schedule ``cpu_schedule*``,
  ``prepack_weights``, ``tuning_db``, ``simplify``);
- ``relay_passes/util/``: helpers that are no pass (``context``, ``pipeline``, ``relax_util``,
  ``lowered``, ``kernels``).

A kernel provider's passes live in its own folder (``providers/<name>/``) and join the pipeline
at their slots (``hgrt.compiler.passes``).

Imports point from passes to ``inner/`` to ``util/``, never back.
"""

from hgrt.relay_passes.apply_tuning import apply_tuning
from hgrt.relay_passes.assign_targets import assign_targets
from hgrt.relay_passes.build_library import build_library
from hgrt.relay_passes.graph.plan_memory import plan_memory, verify_memory
from hgrt.relay_passes.graph_codegen import graph_codegen
from hgrt.relay_passes.insert_copies import insert_copies
from hgrt.relay_passes.legalize_and_fuse import legalize_and_fuse
from hgrt.relay_passes.place_devices import Placement, place_devices
from hgrt.relay_passes.schedule_cpu import schedule_cpu
from hgrt.relay_passes.schedule_gpu import schedule_gpu
from hgrt.relay_passes.util.context import BuildContext, PlacementRow
from hgrt.relay_passes.util.pipeline import Contract, check_order, contract, run_passes

__all__ = [
    "BuildContext", "Contract", "Placement", "PlacementRow", "apply_tuning",
    "assign_targets", "build_library", "check_order", "contract", "graph_codegen",
    "insert_copies", "legalize_and_fuse", "place_devices", "plan_memory",
    "run_passes", "schedule_cpu", "schedule_gpu", "verify_memory",
]
