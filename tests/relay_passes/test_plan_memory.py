"""plan_memory + verify_memory on hand-made and random graphs (no TVM kernels involved)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgrt.errors import PlanError
from hgrt.graph import COPY_FUNC, NOP_FUNC, Graph, Node
from hgrt.lifetimes import ALIGN, memory_report
from hgrt.relay_passes.plan_memory import plan_memory, verify_memory


def make_graph(spec: list[tuple], n_inputs: int, heads: list[int], n_dev: int = 2) -> Graph:
    """spec: (func, [input entry ids], [(shape, dtype)] outputs, device) per op node."""
    nodes, shapes, dtypes, devs, row = [], [], [], [], [0]
    for i in range(n_inputs):
        nodes.append(Node("null", f"in{i}"))
        shapes.append((16 * (i + 1),))
        dtypes.append("float32")
        devs.append(i % 2 % n_dev)
        row.append(row[-1] + 1)
    entry_ref = [(i, 0, 0) for i in range(n_inputs)]
    for func, ins, outs, dev in spec:
        nid = len(nodes)
        nodes.append(Node("tvm_op", f"n{nid}", [entry_ref[e] for e in ins],
                          {"func_name": func, "num_inputs": str(len(ins)),
                           "num_outputs": str(len(outs)), "flatten_data": "0"}))
        for k, (shape, dtype) in enumerate(outs):
            shapes.append(shape)
            dtypes.append(dtype)
            devs.append(dev)
            entry_ref.append((nid, k, 0))
        row.append(row[-1] + len(outs))
    return Graph(nodes=nodes, arg_nodes=list(range(n_inputs)), node_row_ptr=row,
                 heads=[entry_ref[h] for h in heads], shapes=shapes, dtypes=dtypes,
                 storage_ids=list(range(row[-1])), device_index=devs)


@st.composite
def random_graphs(draw):
    n_dev = draw(st.integers(1, 3))
    n_inputs = draw(st.integers(1, 3))
    n_ops = draw(st.integers(1, 25))
    entries = [(d % n_dev, ((16 * (d + 1),), "float32")) for d in range(n_inputs)]
    # entry -> (device, (shape, dtype)); inputs 'live' on device i % 2 → clamp to n_dev
    entries = [(i % 2 % n_dev, t) for i, (_, t) in enumerate(entries)]
    spec = []
    for _ in range(n_ops):
        kind = draw(st.sampled_from(["op", "op", "op", "nop", "copy"]))
        src = draw(st.integers(0, len(entries) - 1))
        if kind == "nop":
            dev, (shape, dtype) = entries[src]
            spec.append((NOP_FUNC, [src], [(shape, dtype)], dev))
            entries.append((dev, (shape, dtype)))
            continue
        if kind == "copy":
            dev = draw(st.integers(0, n_dev - 1))
            spec.append((COPY_FUNC, [src], [entries[src][1]], dev))
            entries.append((dev, entries[src][1]))
            continue
        n_in = draw(st.integers(1, min(3, len(entries))))
        ins = draw(st.lists(st.integers(0, len(entries) - 1), min_size=n_in, max_size=n_in))
        dev = draw(st.integers(0, n_dev - 1))
        outs = [((draw(st.integers(0, 300)), draw(st.integers(1, 4))),
                 draw(st.sampled_from(["float32", "int8", "float16", "int64"])))
                for _ in range(draw(st.integers(1, 2)))]
        spec.append(("kernel", ins, outs, dev))
        entries.extend((dev, o) for o in outs)
    heads = draw(st.lists(st.integers(0, len(entries) - 1), min_size=1, max_size=3))
    return make_graph(spec, n_inputs, heads, n_dev)


def live_ranges(g: Graph) -> list[tuple[int, int]]:
    """Independent lifetime computation per entry: [producer, last reader]; args/heads forever."""
    end = len(g.nodes)
    span = []
    for nid, node in enumerate(g.nodes):
        for _ in range(node.num_outputs):
            span.append([-1, end] if node.op == "null" else [nid, nid])
    for nid, node in enumerate(g.nodes):
        for src, idx, _ in node.inputs:
            e = g.entry_id(src, idx)
            span[e][1] = max(span[e][1], nid)
    for nid, idx, _ in g.heads:
        span[g.entry_id(nid, idx)][1] = end
    # a view keeps its source alive, and the source's bytes are the view's
    for nid, node in enumerate(g.nodes):
        if node.func_name == NOP_FUNC:
            src = g.entry_id(*node.inputs[0][:2])
            out = g.entry_id(nid)
            lo, hi = min(span[src][0], span[out][0]), max(span[src][1], span[out][1])
            span[src] = span[out] = [lo, hi]
    return [tuple(s) for s in span]


def overlaps(g: Graph) -> list[tuple[int, int]]:
    span = live_ranges(g)
    bad = []
    for a in range(g.num_entries):
        for b in range(a + 1, g.num_entries):
            if g.storage_ids[a] == g.storage_ids[b]:
                continue
            if g.entry_device(a) != g.entry_device(b):
                continue
            if span[a][0] > span[b][1] or span[b][0] > span[a][1]:
                continue
            oa, ob = g.storage_offset[g.storage_ids[a]], g.storage_offset[g.storage_ids[b]]
            if oa < ob + g.entry_bytes(b) and ob < oa + g.entry_bytes(a) \
                    and g.entry_bytes(a) and g.entry_bytes(b):
                bad.append((a, b))
    return bad


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_random_plans_have_no_overlap(g):
    planned = plan_memory(g)
    Graph.from_json(planned.to_json())  # the runtime's validation accepts it
    assert overlaps(planned) == []
    for m in memory_report(planned):
        assert m.lower_bound <= m.planned_bytes <= m.no_reuse_bytes
    for nid, node in enumerate(planned.nodes):  # views share their source's storage
        if node.func_name == NOP_FUNC:
            src = planned.entry_id(*node.inputs[0][:2])
            assert planned.storage_ids[planned.entry_id(nid)] == planned.storage_ids[src]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(), st.data())
def test_corrupted_plans_are_caught(g, data):
    planned = plan_memory(g)
    span = live_ranges(planned)
    pairs = [(a, b) for a in range(planned.num_entries) for b in range(planned.num_entries)
             if a < b and planned.storage_ids[a] != planned.storage_ids[b]
             and planned.entry_device(a) == planned.entry_device(b)
             and planned.entry_bytes(a) and planned.entry_bytes(b)
             and span[a][0] <= span[b][1] and span[b][0] <= span[a][1]]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    offsets = list(planned.storage_offset)
    offsets[planned.storage_ids[b]] = offsets[planned.storage_ids[a]]
    pools = list(planned.pool_bytes)
    pools[planned.entry_device(b)] += planned.entry_bytes(b) + ALIGN
    bad = dataclasses.replace(planned, storage_offset=offsets, pool_bytes=pools)
    with pytest.raises(PlanError, match="overlap"):
        verify_memory(bad)


def chain(n: int, dev_of=lambda i: 0) -> Graph:
    spec = [("kernel", [i], [((256,), "float32")], dev_of(i)) for i in range(n)]
    return make_graph(spec, 1, [n])


def test_chain_reuses_memory_and_reaches_the_lower_bound():
    g = plan_memory(chain(10))
    (m,) = memory_report(g)
    assert m.planned_bytes == m.lower_bound < m.no_reuse_bytes
    # the input (64 B, live always) and a kernel's input and output (1024 B each) at a time
    assert m.lower_bound == 64 + 2 * 1024


def test_storage_never_spans_devices():
    g = plan_memory(chain(8, dev_of=lambda i: i % 2))
    owner = {}
    for eid, sid in enumerate(g.storage_ids):
        assert owner.setdefault(sid, g.entry_device(eid)) == g.entry_device(eid)
    assert len(g.pool_bytes) == 2 and all(g.pool_bytes)


def test_inputs_and_outputs_are_never_overwritten():
    n = 8
    spec = [("kernel", [i], [((256,), "float32")], 0) for i in range(n)]
    g = plan_memory(make_graph(spec, 1, heads=[3, n]))  # entry 3 is an output made early
    for keep, born in ((0, -1), (3, 3)):
        lo = g.storage_offset[g.storage_ids[keep]]
        hi = lo + g.entry_bytes(keep)
        for e in range(born + 1, g.num_entries):
            if e == keep:
                continue
            o = g.storage_offset[g.storage_ids[e]]
            assert o >= hi or o + g.entry_bytes(e) <= lo, f"entry {e} overwrites entry {keep}"


def test_verifier_refuses_misaligned_and_out_of_pool():
    g = plan_memory(chain(3))
    offsets = list(g.storage_offset)
    offsets[1] += 4
    with pytest.raises(PlanError, match="multiple of 64"):
        verify_memory(dataclasses.replace(g, storage_offset=offsets))
    with pytest.raises(PlanError, match="outside the pool"):
        verify_memory(dataclasses.replace(g, pool_bytes=[g.pool_bytes[0] - 64]))
    with pytest.raises(PlanError, match="no memory plan"):
        verify_memory(dataclasses.replace(g, pool_bytes=None))
