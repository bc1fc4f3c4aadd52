"""assign_streams: extra streams on a device only while the concurrent memory plan stays within
``1 + memory_slack`` of the sequential one, and a plan that ignores the streams is refused."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest

from hgrt.errors import GraphError, PlanError
from hgrt.graph import Graph
from hgrt.lifetimes import Order, align, group_bytes, live_ranges
from hgrt.relay_passes.graph.assign_streams import assign_streams
from hgrt.relay_passes.graph.plan_memory import plan_memory, pool_bytes, verify_memory
from hgrt.testing import GraphBuilder

BIG, SMALL = (1024,), (16,)


def two_chains(depth: int = 4, shape_b=BIG) -> Graph:
    """Like bench_concurrency's synthetic model: x -> two chains of ``depth`` ops on one
    device, joined by an add; chain b's tensors have ``shape_b``."""
    g = GraphBuilder(shape=BIG)
    x = g.input("x")
    a = b = x
    for i in range(depth):
        a = g.op("add_one", [a], name=f"a{i}")
        b = g.op("add_one", [b], name=f"b{i}", shapes=[shape_b])
    g.output(g.op("add", [a, b], name="join"))
    return Graph.from_json(g.json())


def n_streams(g: Graph) -> int:
    return len({s for s in g.streams if s >= 0})


def ratio(g: Graph) -> float:
    return sum(plan_memory(g).pool_bytes) / sum(plan_memory(two_chains()).pool_bytes)


def clique_bound(g: Graph) -> int:
    """The most activation bytes that must be apart: a heaviest set of entry groups that may
    all be live at once (brute force: small graphs only)."""
    order, weights = Order(g), g.weight_storages
    groups = [x for r, x in live_ranges(g).items() if g.storage_ids[r] not in weights]
    best = 0
    for k in range(1, len(groups) + 1):
        for c in itertools.combinations(groups, k):
            if all(order.conflict(p, q) for p, q in itertools.combinations(c, 2)):
                best = max(best, sum(align(group_bytes(g, x)) for x in c))
    return best


def test_overlapping_chains_cost_a_quarter_more_so_the_device_keeps_one_stream():
    seq = plan_memory(two_chains())
    free = plan_memory(assign_streams(two_chains(), per_device=2, memory_slack=None))
    assert n_streams(free) == 2
    # the planner is not the lever: under the two streams it reaches the bound, 5 tensors of 4
    assert free.pool_bytes[0] == clique_bound(free) == 5 * align(4096)
    assert seq.pool_bytes[0] == clique_bound(seq) == 4 * align(4096)
    capped = assign_streams(two_chains(), per_device=2)
    assert n_streams(capped) == 1
    assert ratio(capped) <= 1.10


def test_cheap_branches_keep_their_streams():
    g = two_chains(shape_b=SMALL)
    capped = plan_memory(assign_streams(g, per_device=2))
    assert n_streams(capped) == 2
    assert sum(capped.pool_bytes) <= 1.10 * sum(plan_memory(g).pool_bytes)


def test_memory_slack_comes_from_the_build_context_and_the_cap_is_logged():
    logged: list[str] = []
    ctx = SimpleNamespace(streams={"per_device": 2}, log=logged.append)
    assert n_streams(assign_streams(two_chains(), ctx)) == 1
    assert "1.25x the sequential plan" in logged[0]
    ctx = SimpleNamespace(streams={"per_device": 2, "memory_slack": 0.5}, log=logged.append)
    assert n_streams(assign_streams(two_chains(), ctx)) == 2
    assert len(logged) == 1


def test_a_plan_that_ignores_the_streams_is_still_refused():
    streamed = assign_streams(two_chains(), per_device=2, memory_slack=None)
    sequential = plan_memory(two_chains())
    racy = dataclasses.replace(sequential, streams=streamed.streams, waits=streamed.waits)
    with pytest.raises(PlanError, match="while both are live"):
        verify_memory(racy)
    with pytest.raises(GraphError, match="while both are live"):
        Graph.from_json(racy.to_json())


def test_pool_bytes_is_what_plan_memory_plans():
    for g in (two_chains(), assign_streams(two_chains(), per_device=2, memory_slack=None)):
        assert pool_bytes(g) == plan_memory(g).pool_bytes
