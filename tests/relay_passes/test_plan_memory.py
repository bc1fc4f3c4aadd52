"""plan_memory + verify_memory on hand-made and random graphs (no TVM kernels involved)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hgrt.errors import GraphError, PlanError
from hgrt.graph import COPY_FUNC, NOP_FUNC, Graph, Node
from hgrt.lifetimes import ALIGN, memory_report
from hgrt.relay_passes.graph.plan_memory import plan_memory, verify_memory


def offer(k: str) -> dict[str, str]:
    """Node attrs offering output 0 the bytes of input ``k`` (a oneDNN kernel's offer)."""
    return {"inplace": k, "provider": "onednn"}


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
    for func, ins, outs, dev, *extra in spec:
        nid = len(nodes)
        nodes.append(Node("tvm_op", f"n{nid}", [entry_ref[e] for e in ins],
                          {"func_name": func, "num_inputs": str(len(ins)),
                           "num_outputs": str(len(outs)), "flatten_data": "0",
                           **(extra[0] if extra else {})}))
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
        offering = len(outs) == 1 and draw(st.booleans())
        if offering:  # writes its output over an input of the same bytes, if the plan lets it
            outs = [entries[ins[0]][1]]
            dev = entries[ins[0]][0]
        spec.append(("kernel", ins, outs, dev, offer("0") if offering else {}))
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
    # a view keeps its source alive, and the source's bytes are the view's; so are the bytes
    # of an output written over its input (``inplace_ok``): one span per group of same bytes
    group = byte_groups(g)
    for members in _members(group).values():
        lo, hi = min(span[e][0] for e in members), max(span[e][1] for e in members)
        for e in members:
            span[e] = [lo, hi]
    return [tuple(s) for s in span]


def _members(group: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e, grp in enumerate(group):
        out.setdefault(grp, []).append(e)
    return out


def byte_groups(g: Graph) -> list[int]:
    """Per entry, the smallest entry of the same bytes: views with their source, an output
    written over its input where ``inplace_ok``."""
    parent = list(range(g.num_entries))

    def find(e: int) -> int:
        while parent[e] != e:
            e = parent[e]
        return e

    for nid, node in enumerate(g.nodes):
        if node.func_name == NOP_FUNC or inplace_ok(g, nid):
            a, b = find(g.entry_id(*node.inputs[node.inplace or 0][:2])), find(g.entry_id(nid))
            parent[max(a, b)] = min(a, b)
    return [find(e) for e in range(g.num_entries)]


def _view_root(g: Graph, e: int) -> int:
    while True:
        node = g.nodes[g.node_of_entry(e)]
        if node.func_name != NOP_FUNC:
            return e
        e = g.entry_id(*node.inputs[0][:2])


def _same_bytes(g: Graph, e: int) -> set[int]:
    """``e`` and its views (and theirs), and what it is a view of."""
    root = _view_root(g, e)
    return {x for x in range(g.num_entries) if _view_root(g, x) == root}


def inplace_ok(g: Graph, nid: int) -> bool:
    """Independently of hgrt.lifetimes: node ``nid`` offers its output the bytes of input k,
    and may have them: the input (with its views) is written by a kernel, read by nothing after
    ``nid`` and by no other operand of it, has no view made after ``nid`` (read or not), and
    neither it nor the output is an input, a param or a graph output; same bytes, dtype and
    device. (No streams in these graphs.)"""
    node = g.nodes[nid]
    k = node.inplace
    if k is None:
        return False
    src, out = g.entry_id(*node.inputs[k][:2]), g.entry_id(nid)
    group = _same_bytes(g, src)
    heads = {g.entry_id(n, i) for n, i, _ in g.heads}
    readers = [(n, j) for n, other in enumerate(g.nodes) for j, i in enumerate(other.inputs)
               if g.entry_id(*i[:2]) in group and other.func_name != NOP_FUNC]
    views = [g.node_of_entry(e) for e in group if e != _view_root(g, src)]
    root = _view_root(g, src)
    return (g.nodes[g.node_of_entry(root)].op != "null" and not group & heads
            and not _same_bytes(g, out) & heads
            and g.entry_bytes(src) == g.entry_bytes(out) and g.dtypes[src] == g.dtypes[out]
            and g.entry_device(src) == g.entry_device(out)
            and all(n < nid or (n == nid and j == k) for n, j in readers)
            and all(n < nid for n in views))


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
    # entries share a storage exactly when they are the same bytes: a view and its source, an
    # output and the input it was offered and may have (and nothing else)
    group = byte_groups(planned)
    for a in range(planned.num_entries):
        for b in range(a):
            assert (planned.storage_ids[a] == planned.storage_ids[b]) == (group[a] == group[b])


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


def _offer_chain(reads_after: bool = False, heads=None) -> Graph:
    """in0 -> a -> b (offers a's bytes) -> c; with ``reads_after`` c reads a too."""
    f = ((256,), "float32")
    spec = [("kernel", [0], [f], 0),
            ("kernel", [1], [f], 0, offer("0")),
            ("kernel", [2, 1] if reads_after else [2], [f], 0)]
    return make_graph(spec, 1, heads or [3])


def _residual_block(offers: bool) -> Graph:
    """a = k(in0); b = k(a); c = k(b, a), offering c a's bytes (a residual add); d = k(c)."""
    f = ((256,), "float32")
    return make_graph([("kernel", [0], [f], 0), ("kernel", [1], [f], 0),
                       ("kernel", [2, 1], [f], 0, offer("1") if offers else {}),
                       ("kernel", [3], [f], 0)], 1, [4])


def test_an_output_takes_the_bytes_of_the_input_that_dies_there():
    g = plan_memory(_residual_block(offers=True))
    assert g.storage_ids[g.entry_id(1)] == g.storage_ids[g.entry_id(3)]
    (m,), (m0,) = memory_report(g), memory_report(plan_memory(_residual_block(offers=False)))
    assert m.planned_bytes == m.lower_bound == m0.planned_bytes - 1024  # a 1 KiB tensor less
    Graph.from_json(g.to_json())  # the loader's verifier accepts the overlap
    chain = plan_memory(_offer_chain())  # in a chain too (no bytes saved there)
    assert chain.storage_ids[chain.entry_id(1)] == chain.storage_ids[chain.entry_id(2)]


@pytest.mark.parametrize("case", ["read later", "graph output", "graph input", "operand twice"])
def test_an_offer_is_not_taken_where_the_input_lives_on(case):
    f = ((256,), "float32")
    if case == "read later":
        g = _offer_chain(reads_after=True)
    elif case == "graph output":
        g = _offer_chain(heads=[1, 3])  # a is an output of the graph
    elif case == "graph input":
        g = make_graph([("kernel", [0], [((16,), "float32")], 0, offer("0"))], 1, [1])
    else:  # b reads a twice: writing over one operand would change the other
        g = make_graph([("kernel", [0], [f], 0), ("kernel", [1, 1], [f], 0, offer("0")),
                        ("kernel", [2], [f], 0)], 1, [3])
    planned = plan_memory(g)
    src = planned.entry_id(*planned.nodes[2].inputs[0][:2]) if case != "graph input" else 0
    assert planned.storage_ids[src] != planned.storage_ids[planned.entry_id(
        2 if case != "graph input" else 1)]


def test_a_plan_that_writes_over_an_input_still_read_is_refused():
    """The offer stands in the graph, but c reads a after b wrote over it: a hand-made plan
    putting b in a's bytes is refused, naming both entries, by the planner's verifier and by
    the graph loader."""
    good = plan_memory(_offer_chain(reads_after=True))
    a, b = good.entry_id(1), good.entry_id(2)
    sids = list(good.storage_ids)
    sids[b] = sids[a]
    bad = dataclasses.replace(good, storage_ids=sids)
    with pytest.raises(PlanError, match=f"entries {a} and {b}"):
        verify_memory(bad)
    with pytest.raises(GraphError, match="share pool bytes"):
        Graph.from_json(bad.to_json())


def test_an_offer_across_streams_is_taken_only_after_the_other_readers():
    """in0 -> a (stream 0); r reads a on stream 1; b offers to write over a on stream 0; c reads
    b and r. Without an event from r before b, r may still read a while b writes: not taken;
    with one, taken."""
    f = ((256,), "float32")
    spec = [("kernel", [0], [f], 0), ("kernel", [1], [f], 0),
            ("kernel", [1], [f], 0, offer("0")), ("kernel", [3, 2], [f], 0)]
    base = make_graph(spec, 1, [4])
    for waits, taken in (([[], [], [1], [], [2]], False), ([[], [], [1], [2], [2]], True)):
        g = plan_memory(dataclasses.replace(base, streams=[-1, 0, 1, 0, 0], waits=waits))
        assert (g.storage_ids[g.entry_id(1)] == g.storage_ids[g.entry_id(3)]) == taken
        Graph.from_json(g.to_json())


def test_the_graph_refuses_an_offer_of_an_input_it_does_not_have():
    g = _offer_chain()
    doc = json.loads(g.to_json())
    doc["nodes"][2]["attrs"]["inplace"] = "3"
    with pytest.raises(GraphError, match="inplace = 3 names no input"):
        Graph.from_json(doc)


def test_a_view_after_the_offer_keeps_the_input_and_the_plan_verifies():
    """a -> b (over a) -> c (over b), and a view of a that nothing reads after c: the view keeps
    a live past b, so neither offer on a's bytes is taken by a plan its verifier refuses."""
    f = ((256,), "float32")
    g = plan_memory(make_graph([("kernel", [0], [f], 0), ("kernel", [1], [f], 0, offer("0")),
                                ("kernel", [2], [f], 0, offer("0")), (NOP_FUNC, [1], [f], 0),
                                ("kernel", [3], [f], 0)], 1, [5]))
    sid = g.storage_ids
    assert sid[g.entry_id(1)] != sid[g.entry_id(2)]  # a lives on in its view
    assert sid[g.entry_id(2)] == sid[g.entry_id(3)]  # b dies at c
    Graph.from_json(g.to_json())


def test_only_kernels_that_read_before_they_write_may_offer():
    doc = json.loads(_offer_chain().to_json())
    del doc["nodes"][2]["attrs"]["provider"]  # a TVM kernel: its schedule may read late
    with pytest.raises(GraphError, match="inplace on a kernel of provider 'tvm'"):
        Graph.from_json(doc)
