"""assign_streams: give every kernel and copy a stream, and each cross-stream edge an event.

A stream is a queue of steps that one worker runs in order; streams run at the same time.
Like a logical stream allocator: a node continues its producer's stream when it is that
producer's first consumer on the same device; otherwise it opens a new stream of its device,
up to ``per_device`` streams, beyond which it joins the device's stream that frees first in
node order. A copy runs on its destination device. A node waits for a producer on another
stream only when no earlier wait already orders them (vector clocks), so events are few.
``single_stream=True`` puts every step on one stream: the graph then runs as one without
streams, in node order.

    graph = assign_streams(graph, ctx)   # graph.streams / graph.waits, in the JSON's hgrt section
"""

from __future__ import annotations

import dataclasses

from hgrt.graph import Graph
from hgrt.lifetimes import Order, runs


def _producers(g: Graph, nid: int, roots: list[int]) -> list[int]:
    """The nodes that run and write what ``nid`` reads (through ``__nop`` views)."""
    found = []
    for src, idx, _ in g.nodes[nid].inputs:
        writer = g.node_of_entry(roots[g.entry_id(src, idx)])
        if runs(g.nodes[writer]) and writer not in found:
            found.append(writer)
    return found


def assign_streams(graph: Graph, ctx: object = None, *, per_device: int = 1,
                   single_stream: bool = False) -> Graph:
    """``graph`` with ``streams`` (per node) and ``waits`` (per node: nodes of other streams
    it waits for). Options from ``ctx.streams`` (``{"per_device": n, "single_stream": b}``)
    when the build context has them."""
    opts = getattr(ctx, "streams", None) or {}
    per_device = opts.get("per_device", per_device)
    single_stream = opts.get("single_stream", single_stream)
    if single_stream:  # one stream over all devices: the sequential run, no section needed
        return dataclasses.replace(graph, streams=None, waits=None)
    g, roots = graph, graph.alias_roots()
    streams = [-1] * len(g.nodes)
    device_of: list[int] = []  # stream -> device
    continued: set[int] = set()  # producers whose stream a consumer already continued
    tail: dict[int, int] = {}  # stream -> its last node
    for nid, node in enumerate(g.nodes):
        if not runs(node):
            continue
        dev = g.entry_device(g.entry_id(nid))
        mine = [s for s, d in enumerate(device_of) if d == dev]
        reuse = next((p for p in _producers(g, nid, roots) if p not in continued
                      and streams[p] in mine and tail[streams[p]] == p), None)
        if reuse is not None:
            continued.add(reuse)
            s = streams[reuse]
        elif len(mine) < per_device:
            s = len(device_of)
            device_of.append(dev)
        else:
            s = min(mine, key=lambda m: tail[m])  # the one whose last node came earliest
        streams[nid], tail[s] = s, nid
    return dataclasses.replace(graph, streams=streams, waits=_waits(g, streams, roots))


def _waits(g: Graph, streams: list[int], roots: list[int]) -> list[list[int]]:
    """A wait for each producer on another stream that earlier waits do not already order
    (latest producer first: waiting for it often orders the others too)."""
    order, waits = Order(), []
    for nid, s in enumerate(streams):
        order.add(s)
        mine = []
        if s >= 0:
            for p in sorted(_producers(g, nid, roots), key=lambda p: -order.pos[p]):
                if streams[p] != s and not order.before(p, nid):
                    order.wait(nid, p)
                    mine.append(p)
        waits.append(sorted(mine))
    return waits
