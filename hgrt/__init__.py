"""hgrt: a heterogeneous graph runtime for Apache TVM.

Compile a model once (``hgrt.build``), run it across a CPU and an accelerator
(``hgrt.create``), locally or on a remote machine through TVM RPC.
"""

import hgrt.spin  # noqa: F401  (first: libgomp reads its spin settings when TVM loads it)
from hgrt.api import create, load
from hgrt.artifacts import save
from hgrt.errors import (
    BuildError,
    ClosedError,
    DeviceError,
    ExecutionError,
    GraphError,
    HgrtError,
    InputError,
    ParamError,
    PlanError,
    ProvisionError,
    RemoteError,
)
from hgrt.graph import Graph, Node
from hgrt.host import Host
from hgrt.rpc.client import RemoteGraphModule
from hgrt.runtime.executor import GraphModule
from hgrt.runtime.module_api import BenchmarkResult, GraphModuleAPI

__version__ = "0.1.0"


def __getattr__(name):
    # The compiler pulls in TVM's Relax stack; import it only when asked for.
    if name in ("split", "StageSpec", "pipeline", "load_pipeline", "Pipeline"):
        import importlib

        for module, names in (("hgrt.stages", ("split", "StageSpec")),
                              ("hgrt.pipelines", ("pipeline", "load_pipeline", "Pipeline"))):
            for public in names:
                globals()[public] = getattr(importlib.import_module(module), public)
        return globals()[name]
    if name in ("build", "Kernels", "Placement", "BuildResult", "lower_model"):
        import importlib

        module = importlib.import_module("hgrt.compiler")
        for public in ("build", "Kernels", "Placement", "BuildResult", "lower_model"):
            globals()[public] = getattr(module, public)
        return globals()[name]
    raise AttributeError(f"module 'hgrt' has no attribute {name!r}")


__all__ = [
    "BenchmarkResult", "BuildError", "BuildResult", "ClosedError", "DeviceError",
    "ExecutionError", "Graph", "GraphError", "GraphModule", "GraphModuleAPI", "HgrtError", "Host",
    "InputError", "Kernels", "Node", "ParamError", "Pipeline", "Placement", "PlanError",
    "ProvisionError", "RemoteError", "RemoteGraphModule", "StageSpec", "build", "create", "load",
    "load_pipeline", "pipeline", "save", "split",
]
