"""The pipeline passes on the graph after ``graph_codegen``: each is ``pass(graph, ctx) -> graph``
over an ``hgrt.graph.Graph``, one per file, named after the pass (``concat_views``,
``assign_streams``, ``plan_memory``)."""
