"""hgrt.build on small random Relax graphs under random placements: Placement overrides,
``R.hint_on_device`` hints, or a module that places itself (vdevices in its global infos,
``R.to_vdevice`` where an operand lives elsewhere). Either the build runs and equals the Relax VM
on one device, or it raises an HgrtError; an error that TVM raised names the pass, the binding,
its op and device, and keeps TVM's exception as its cause. A graph that the Relax VM runs must
build: refusing it fails the test, unless the refusal is one of ``ACCEPTED_REFUSALS``."""

from __future__ import annotations

import re

import numpy as np
import tvm
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tvm import relax

import hgrt
from hgrt.frontend import import_model
from hgrt.relay_passes.place_devices import op_bindings
from hgrt.testing import run_hgrt, run_relax_vm

SHAPE = (2, 3)
UNARY = {
    "relu": relax.op.nn.relu, "neg": relax.op.negative, "tanh": relax.op.tanh,
    "half": lambda a: relax.op.multiply(a, relax.const(0.5, "float32")),
    "T": lambda a: relax.op.permute_dims(a, list(range(len(a.ty.shape.values)))[::-1]),
    "flat": lambda a: relax.op.reshape(a, (-1,)),
    "sum0": lambda a: relax.op.sum(a, [0], keepdims=True),
    # a slope of 5 on an axis of 2 or 3: TVM's legalization fails with a bare AssertionError
    "bad_prelu": lambda a: relax.op.nn.prelu(a, relax.const(np.ones(5, "float32")), axis=0),
}
BINARY = {"add": relax.op.add, "sub": relax.op.subtract, "mul": relax.op.multiply,
          "max": relax.op.maximum, "cat": lambda a, b: relax.op.concat([a, b], 0)}
MODES = ("overrides", "hints", "vdevices")
VDEVICES = [relax.VDevice(tvm.target.Target("llvm"), i, "global") for i in range(2)]
LOCATED = re.compile(r"^'\w+' failed after \[.*\]: binding '\w+' \([\w.]+\) on cpu:[01]: ")

# Refusals of graphs that the Relax VM runs which are right all the same, as
# (error class, a substring of its message, why it is right). Any other refusal of such a graph
# fails the test.
ACCEPTED_REFUSALS: tuple[tuple[type[hgrt.HgrtError], str, str], ...] = (
    (hgrt.BuildError, "fits no axis it may mean",
     "a prelu whose slope has a size no axis of its input has: TVM's legalization asserts on "
     "it in hgrt's pipeline where the VM's runs it; hgrt refuses it at import, naming it"),
)


def _operands(vals: list, i: int, j: int, op: str) -> tuple:
    (a, da), (b, db) = vals[i % len(vals)], vals[j % len(vals)]
    shape_a, shape_b = (list(x.ty.shape.values) for x in (a, b))
    if shape_a[1:] != shape_b[1:] or (op != "cat" and shape_a != shape_b):
        return (a, da), (a, da)
    return (a, da), (b, db)


def _graph(steps: list, n_in: int, outs: list, mode: str) -> tuple[tvm.IRModule, dict]:
    """main(x0.., w): step (op, i, j, dev) applies op to values i, j on cpu:dev; returns the
    values ``outs`` names. Also the device each binding was given."""
    vd = VDEVICES[0] if mode == "vdevices" else None
    ins = [relax.Var(f"x{k}", relax.TensorType(SHAPE, "float32", vd)) for k in range(n_in)]
    w = relax.Var("w", relax.TensorType(SHAPE, "float32", vd))
    bb, where = relax.BlockBuilder(), {}
    with bb.function("main", [*ins, w]):
        with bb.dataflow():
            vals = [(v, 0) for v in [*ins, w]]
            for k, (op, i, j, dev) in enumerate(steps):
                operands = _operands(vals, i, j, op)
                if mode == "vdevices":  # the module moves what it reads itself
                    operands = [(x if d == dev else bb.emit(relax.op.to_vdevice(
                        x, VDEVICES[dev])), d) for x, d in operands]
                a, b = (x for x, _ in operands)
                v = bb.emit(UNARY[op](a) if op in UNARY else BINARY[op](a, b), name_hint=f"v{k}")
                where[v.name] = f"cpu:{dev}"
                if mode == "hints":
                    v = bb.emit(relax.op.hint_on_device(v, tvm.cpu(dev)))
                vals.append((v, dev))
            picked = [vals[o % len(vals)][0] for o in outs]
            out = bb.emit_output(relax.Tuple(picked) if len(picked) > 1 else picked[0])
        bb.emit_func_output(out)
    mod = bb.finalize()
    if mode == "vdevices":
        mod.update_global_info("vdevice", VDEVICES)
    return mod, where


def _placement(mod: tvm.IRModule, where: dict, w: np.ndarray) -> hgrt.Placement:
    """Overrides for the bindings that import keeps (weight-only ones are folded away)."""
    kept = {name for name, _ in op_bindings(import_model(mod, {"w": w})[0])}
    return hgrt.Placement(overrides={k: v for k, v in where.items() if k in kept})


def _reference(steps: list, n_in: int, outs: list, xs: list, w: np.ndarray) -> list | None:
    try:
        mod = relax.transform.DeadCodeElimination()(_graph(steps, n_in, outs, "none")[0])
        return run_relax_vm(mod, xs, {"w": w})  # ops nobody reads are not built by hgrt either
    except Exception:
        return None  # the VM cannot run it either: hgrt must say why


step = st.tuples(st.sampled_from([*UNARY, *BINARY]), st.integers(0, 7), st.integers(0, 7),
                 st.integers(0, 1))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, max_size=5), n_in=st.integers(1, 2), mode=st.sampled_from(MODES),
       outs=st.lists(st.integers(-3, 7), min_size=1, max_size=2))
@example(steps=[("relu", 0, 0, 1), ("bad_prelu", 2, 0, 1)], n_in=1, mode="vdevices", outs=[-1])
@example(steps=[], n_in=1, mode="vdevices", outs=[1, 0])  # no kernels: outputs are inputs
@example(steps=[("tanh", 0, 0, 1), ("cat", 0, 2, 0)], n_in=1, mode="hints", outs=[-1, 2])
def test_random_graph_builds_right_or_raises_hgrt_error(steps, n_in, outs, mode):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(SHAPE).astype("float32") for _ in range(n_in)]
    w = rng.standard_normal(SHAPE).astype("float32")
    want = _reference(steps, n_in, outs, xs, w)
    mod, where = _graph(steps, n_in, outs, mode)
    try:  # (the overrides name the bindings of the imported module: imported in here)
        placement = _placement(mod, where, w) if mode == "overrides" else None
        res = hgrt.build(mod, ["cpu:0", "cpu:1"], placement, params={"w": w})
    except hgrt.HgrtError as e:
        if not isinstance(e.__cause__, (hgrt.HgrtError, type(None))):
            assert LOCATED.match(str(e)), str(e)  # TVM failed: say where
        accepted = any(isinstance(e, cls) and text in str(e)
                       for cls, text, _ in ACCEPTED_REFUSALS)
        assert want is None or accepted, \
            f"hgrt.build refused a graph that the Relax VM runs: {type(e).__name__}: {e}"
        return
    assert want is not None, "hgrt built a graph that the Relax VM cannot run"
    got = run_hgrt(res, {f"x{k}": x for k, x in enumerate(xs)})
    assert len(got) == len(want)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
