"""hgrt.runtime: the graph executor and its device storage pools."""

from hgrt.runtime.executor import BenchmarkResult, GraphModule, create

__all__ = ["BenchmarkResult", "GraphModule", "create"]
