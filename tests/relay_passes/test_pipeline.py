"""run_passes names the broken pass and what ran before it; verify mode checks the IR; every pass
keeps its contract: the order of PASSES is checked, and a real build touches no context field
that a pass did not declare."""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import hgrt
from hgrt import compiler
from hgrt.errors import BuildError, PlanError
from hgrt.providers.cudalibs import kernels as cudalibs
from hgrt.providers.onednn import kernels as onednn
from hgrt.relay_passes import run_passes
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.pipeline import CONTEXT_FIELDS, check_order, contract
from hgrt.testing import alternating, conv_model


@I.ir_module
class Mod:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            y = R.add(x, x)
            R.output(y)
        return y


@contract()
def ok(mod, ctx):
    return mod


@contract()
def boom(mod, ctx):
    raise RuntimeError("kaput")


@contract()
def plan_boom(mod, ctx):
    raise PlanError("overlap")


def test_failure_names_pass_and_history():
    with pytest.raises(BuildError, match=r"^'second' failed after \['first'\]: kaput"):
        run_passes(Mod, None, [("first", ok), ("second", boom), ("third", ok)])


def test_hgrt_errors_keep_their_class():
    with pytest.raises(PlanError, match=r"'plan' failed after \[\]: overlap"):
        run_passes(Mod, None, [("plan", plan_boom)])


def test_verify_catches_ill_formed_ir():
    @contract()
    def break_ir(mod, ctx):
        f = mod["main"]
        stray = relax.Var("stray", relax.TensorType((4,), "float32"))
        bad = relax.Function(f.params, relax.SeqExpr(f.body.blocks, stray), f.ret_ty,
                             f.is_pure, f.attrs)
        new = mod.clone()
        new.update_func(new.get_global_var("main"), bad)
        return new

    assert run_passes(Mod, None, [("break", break_ir)], verify=False) is not None
    with pytest.raises(BuildError, match="not well formed after 'break'"):
        run_passes(Mod, None, [("ok", ok), ("break", break_ir)], verify=True)


# --- the order: each pass after the passes its contract names ----------------------------------


def swapped(first: str, second: str) -> list[tuple[str, Any]]:
    passes = list(compiler.PASSES)
    names = [n for n, _ in passes]
    i, j = names.index(first), names.index(second)
    passes[i], passes[j] = passes[j], passes[i]
    return passes


def test_passes_and_every_prefix_keep_the_order():
    for k in range(len(compiler.PASSES) + 1):  # lower_model runs a prefix
        check_order(compiler.PASSES[:k])


@pytest.mark.parametrize(("first", "second", "message"), [
    ("place_devices", "insert_copies", r"^'insert_copies' needs 'place_devices' to run before it, "
     r"but it runs after \[\] \(it reads ctx.placed, which 'place_devices' writes\)"),
    ("claim_onednn", "fold_batch_norm", r"^'claim_onednn' must run before 'fold_batch_norm', "
     r"but it runs after \[.*'fold_batch_norm'\]"),  # a provider's pass says where it belongs
    ("assign_targets", "apply_tuning", r"^'apply_tuning' needs 'assign_targets'"),
    ("assign_streams", "plan_memory", r"^'plan_memory' needs 'assign_streams'"),
])
def test_a_pass_listed_before_one_it_needs_is_refused(first, second, message):
    with pytest.raises(BuildError, match=message):
        check_order(swapped(first, second))
    with pytest.raises(BuildError, match=message):  # run_passes checks before it runs any
        run_passes(Mod, None, swapped(first, second))


def test_a_missing_pass_and_an_undeclared_pass_are_refused():
    without = [p for p in compiler.PASSES if p[0] != "place_devices"]
    with pytest.raises(BuildError, match=r"'insert_copies' needs 'place_devices' to run before "
                                         r"it, but the passes hold no 'place_devices'"):
        check_order(without)
    with pytest.raises(BuildError, match=r"pass 'bare' declares no contract"):
        check_order([("bare", lambda mod, ctx: mod)])


def test_a_contract_names_only_context_fields():
    with pytest.raises(TypeError, match=r"'weight' not found; did you mean 'weights'"):
        contract(reads={"weight"})


# --- what each pass touches of a real build's context ------------------------------------------


def snapshot(x: Any) -> Any:
    """``x``'s state: plain values as they are, containers and dataclasses by their items, any
    other object by its identity (a weight replaced is a change; bytes written into an array
    in place are not seen)."""
    if x is None or isinstance(x, str | int | float | bool):
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (id(x), *(snapshot(getattr(x, f.name)) for f in dataclasses.fields(x)))
    if isinstance(x, dict):
        return (id(x), *((k, snapshot(v)) for k, v in x.items()))
    if isinstance(x, list | tuple):
        return (id(x), *(snapshot(v) for v in x))
    return id(x)


@dataclasses.dataclass
class Record:
    """Per pass: the context fields it got or set, and those whose state it changed."""

    got: dict[str, set[str]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    changed: dict[str, set[str]] = dataclasses.field(default_factory=lambda: defaultdict(set))
    running: str | None = None


def recording(record: Record) -> tuple[type[BuildContext], tuple]:
    """A BuildContext class and PASSES that fill ``record`` while the passes run."""

    class RecordingContext(BuildContext):
        def __getattribute__(self, name: str) -> Any:
            if record.running is not None and name in CONTEXT_FIELDS:
                record.got[record.running].add(name)
            return super().__getattribute__(name)

        def __setattr__(self, name: str, value: Any) -> None:
            if record.running is not None and name in CONTEXT_FIELDS:
                record.changed[record.running].add(name)
            super().__setattr__(name, value)

        def log(self, msg: str) -> None:  # the log's own look at ``verbose`` is no pass's
            running, record.running = record.running, None
            try:
                super().log(msg)
            finally:
                record.running = running

    def recorded(name: str, fn: Any) -> Any:
        @functools.wraps(fn)  # (the contract comes along: run_passes checks the order)
        def run(ir: Any, ctx: BuildContext) -> Any:
            before = {f: snapshot(getattr(ctx, f)) for f in CONTEXT_FIELDS}
            record.running = name
            try:
                return fn(ir, ctx)
            finally:
                record.running = None
                record.changed[name] |= {f for f in CONTEXT_FIELDS
                                         if snapshot(getattr(ctx, f)) != before[f]}
        return run

    return RecordingContext, tuple((n, recorded(n, fn)) for n, fn in compiler.PASSES)


def branchy_model():
    """x -> BatchNormalization -> Relu -> a; three convolutions of a (Relu each: r0, r1, r2);
    Conv 1x1 of Concat(r0, r1) -> Relu -> y1; s = Concat(y1, r2), an output; z = Relu(s * k +
    d): a batch norm to fold, a concat to split, a concat to view, an affine chain to claim."""
    rng = np.random.default_rng(0)
    inits = []

    def init(name, shape, positive=False):
        v = rng.standard_normal(shape).astype("float32")
        inits.append(numpy_helper.from_array(np.abs(v) + 0.5 if positive else v, name))
        return name

    stats = [init("g", (4,)), init("beta", (4,)), init("m", (4,)), init("v", (4,), True)]
    nodes = [helper.make_node("BatchNormalization", ["x", *stats], ["bn"]),
             helper.make_node("Relu", ["bn"], ["a"])]
    for i, k in enumerate((1, 3, 1)):
        nodes += [helper.make_node("Conv", ["a", init(f"e{i}", (4, 4, k, k))], [f"c{i}"],
                                   pads=[k // 2] * 4),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
    nodes += [helper.make_node("Concat", ["r0", "r1"], ["cat"], axis=1),
              helper.make_node("Conv", ["cat", init("w", (4, 8, 1, 1)), init("b", (4,))],
                               ["y0"]),
              helper.make_node("Relu", ["y0"], ["y1"]),
              helper.make_node("Concat", ["y1", "r2"], ["s"], axis=1),
              helper.make_node("Mul", ["s", init("k", (8, 1, 1))], ["sk"]),
              helper.make_node("Add", ["sk", init("d", (8, 1, 1))], ["skd"]),
              helper.make_node("Relu", ["skd"], ["z"])]
    graph = helper.make_graph(
        nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("s", "z")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


BUILDS = {  # name -> (model, build)
    "one cpu": (conv_model, lambda m: hgrt.build(m, ["cpu"], kernels="tvm")),
    "two cpus": (conv_model, lambda m: hgrt.build(m, ["cpu:0", "cpu:1"], alternating(m),
                                                  streams={"per_device": 2}, kernels="tvm")),
    "auto placement": (conv_model, lambda m: hgrt.build(m, ["cpu:0", "cpu:1"],
                                                        hgrt.Placement(auto=True))),
    "onednn": (conv_model, lambda m: hgrt.build(m, ["cpu"], kernels="onednn")),
    "branchy": (branchy_model, lambda m: hgrt.build(m, ["cpu"], kernels="tvm")),
    "branchy onednn": (branchy_model, lambda m: hgrt.build(m, ["cpu"], kernels="onednn")),
    "cudalibs": (conv_model, lambda m: hgrt.build(
        m, ["cuda:0", "cpu:0"], hgrt.Placement(preferred="cuda:0", fallback="cpu:0"),
        kernels="cudalibs")),
}


@pytest.fixture(scope="module")
def records() -> dict[str, Record]:
    out = {}
    for build, (model, run) in BUILDS.items():
        if "onednn" in build and onednn.unavailable_reason() is not None:
            continue
        if build == "cudalibs" and cudalibs.unavailable_reason() is not None:
            continue
        record = Record()
        context, passes = recording(record)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(compiler, "BuildContext", context)
            mp.setattr(compiler, "PASSES", passes)
            run(model())
        out[build] = record
    return out


def undeclared(record: Record) -> list[str]:
    """What the passes did to the context beyond their contracts."""
    wrong = []
    for name, fn in compiler.PASSES:
        c = fn.contract
        wrong += [f"'{name}' uses ctx.{f}, which its contract neither reads nor writes"
                  for f in sorted(record.got[name] - c.reads - c.writes)]
        wrong += [f"'{name}' changes ctx.{f}, which its contract does not write"
                  for f in sorted(record.changed[name] - c.writes)]
    return wrong


@pytest.mark.parametrize("build", list(BUILDS))
def test_passes_touch_only_what_they_declare(records, build):
    if build not in records:
        pytest.skip(f"oneDNN or cuBLAS/cuDNN unavailable: {onednn.unavailable_reason()}, "
                    f"{cudalibs.unavailable_reason()}")
    assert set(records[build].changed) == {n for n, _ in compiler.PASSES}  # all were watched
    assert undeclared(records[build]) == []


def test_the_recorder_sees_what_a_pass_does():
    record = Record()
    context, _ = recording(record)
    ctx = context(devices=[])
    record.running = "p"
    ctx.placed.op_device["x"] = 0  # got: placed
    ctx.lowered = ctx.lowered  # set: lowered
    ctx.log("quiet")  # verbose, read by the log, is nobody's
    assert record.got == {"p": {"placed", "lowered"}} and record.changed == {"p": {"lowered"}}


# declared, yet no build above takes the branch that uses it
UNSEEN = {"apply_tuning": {"lowered"},  # a tuning database
          "schedule_cpu": {"weights"},  # a weight prepacked for its tile
          "build_library": {"devices"},  # a library of no kernels: the host target
          "graph_codegen": {"weights"}}  # a constant left inline


def test_every_declared_field_is_used(records):
    if len(records) < len(BUILDS):
        pytest.skip(f"oneDNN or cuBLAS/cuDNN unavailable: {onednn.unavailable_reason()}, "
                    f"{cudalibs.unavailable_reason()}")
    unused = {}
    for name, fn in compiler.PASSES:
        got = set().union(*(r.got[name] for r in records.values()))
        changed = set().union(*(r.changed[name] for r in records.values()))
        if left := (fn.contract.reads - got) | (fn.contract.writes - changed):
            unused[name] = left
    assert unused == UNSEEN
