"""hgrt.runtime: the graph executor and its device storage pools."""

from hgrt.runtime.executor import GraphModule, Step, create
from hgrt.runtime.module_api import BenchmarkResult, GraphModuleAPI

__all__ = ["BenchmarkResult", "GraphModule", "GraphModuleAPI", "Step", "create"]
