"""claim_affine: the per-channel chains after oneDNN kernels run as one oneDNN kernel, equal to
the Relax VM, and only where the module doc says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.providers.onednn import kernels as onednn
from hgrt.testing import build_and_compare, onnx_inputs, reference, run_hgrt

REASON = onednn.unavailable_reason()
needs_onednn = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")
TOL = {"rtol": 1e-4, "atol": 1e-4}
C = 11  # 5 + 6 channels: a scale read along the wrong axis gives wrong numbers
H, W = 6, 7
# ONNX spelling of a link: (op, constant first?)
LINKS = {"mul": ("Mul", False), "add": ("Add", False), "sub": ("Sub", False),
         "rsub": ("Sub", True), "div": ("Div", False), "rdiv": ("Div", True)}
NAMES = {"mul": "multiply", "add": "add", "sub": "subtract", "rsub": "subtract",
         "div": "divide", "relu": "relu"}


def chain_onnx(links, const_shape=(C, 1, 1), also_output=None, zero_divisor=False,
               sigmoid_of=None, seed=0):
    """x -> two convolutions (5 and 6 channels) -> Concat -> the ``links`` (``bn``, a
    ``LINKS`` key with a constant of ``const_shape``, ``relu``, ``sigmoid``) -> 1x1 Conv -> y
    (``rdiv``: the constant divided by the tensor, which does not fold; ONNX's Clip
    imports as two TIR kernels, not ``R.clip``: ``test_clip_ends_a_chain``);
    ``also_output``: the index of a link whose result is also an output; ``sigmoid_of``: the
    index of a link whose result a Sigmoid (a TVM kernel, output ``s``) also reads."""
    rng = np.random.default_rng(seed)
    inits: list = []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, "float32"), name))
        return name

    nodes = [helper.make_node("Conv", ["x", init("e0", rng.standard_normal((5, 3, 1, 1)))],
                              ["c0"]),
             helper.make_node("Conv", ["x", init("e1", rng.standard_normal((6, 3, 3, 3)))],
                              ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Concat", ["c0", "c1"], ["t0"], axis=1)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    for i, link in enumerate(links):
        src, dst = f"t{i}", f"t{i + 1}"
        if link == "bn":
            stats = [init(f"{n}{i}", rng.uniform(0.5, 1.5, C) if n in "gv" else
                          rng.standard_normal(C)) for n in ("g", "beta", "m", "v")]
            nodes.append(helper.make_node("BatchNormalization", [src, *stats], [dst]))
        elif link in ("relu", "sigmoid"):
            nodes.append(helper.make_node(link.capitalize(), [src], [dst]))
        else:
            op, const_first = LINKS[link]
            value = rng.uniform(0.5, 1.5, const_shape) * rng.choice([-1, 1], const_shape)
            if zero_divisor and link == "div":
                value.reshape(-1)[0] = 0.0
            k = init(f"k{i}", value)
            nodes.append(helper.make_node(op, [k, src] if const_first else [src, k], [dst]))
        if also_output == i:
            outputs.append(helper.make_tensor_value_info(dst, TensorProto.FLOAT, None))
        if sigmoid_of == i:
            nodes.append(helper.make_node("Sigmoid", [dst], ["s"]))
            outputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    nodes.append(helper.make_node("Conv", [f"t{len(links)}",
                                           init("w", rng.standard_normal((4, C, 1, 1)))], ["y"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, 3, H, W])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _build_and_check(model, kernels="onednn"):
    return build_and_compare(model, kernels=kernels, **TOL)


def _affine(res) -> list:
    return [n for n in res.graph.nodes if n.op != "null"
            and n.attrs.get("func_name") == "hgrt.onednn.affine"]


@needs_onednn
def test_a_batch_norm_scale_and_relu_after_a_concat_are_one_onednn_kernel_in_place():
    res = _build_and_check(chain_onnx(["bn", "mul", "add", "relu"]))
    (node,) = _affine(res)
    assert node.attrs["onednn_op"] == "multiply+add+multiply+add+relu"
    assert node.attrs["provider"] == "onednn" and node.attrs["inplace"] == "0"
    g = res.graph
    kernels = [n.attrs["func_name"] for n in g.nodes if n.op != "null"]
    assert not [k for k in kernels if not k.startswith("hgrt.onednn.")], kernels
    # the concat dies at the chain: the plan gives the chain's output its bytes
    nid = g.nodes.index(node)
    x = g.entry_id(*node.inputs[0][:2])
    assert g.storage_ids[g.entry_id(nid)] == g.storage_ids[x]
    # one weight holds the folded chain; the statistics and constants it read are gone
    assert [p for p in res.params if p.endswith(".affine")] == ["g0.bn_scale.affine"]
    assert not {"g0", "beta0", "m0", "v0", "k1", "k2"} & set(res.params)
    rows = [r for r in res.placement_report if r.kernels == "onednn" and "relu" in r.op]
    assert rows, "the placement report says who computes the chain"


@needs_onednn
@settings(max_examples=10, deadline=None, derandomize=True)
@given(links=st.lists(st.sampled_from(sorted(set(LINKS) - {"rdiv"})), min_size=1, max_size=4),
       act=st.sampled_from([None, "relu"]),
       const_shape=st.sampled_from([(C, 1, 1), (1, C, 1, 1), (1,)]))
def test_random_chains_equal_the_relax_vm(links, act, const_shape):
    res = _build_and_check(chain_onnx(links + ([act] if act else []), const_shape))
    (node,) = _affine(res)
    assert node.attrs["onednn_op"] == "+".join(NAMES[k] for k in links + ([act] if act else []))


@needs_onednn
@pytest.mark.parametrize("links, claimed, sigmoid_of", [
    (["rsub", "div", "mul", "sub", "add", "relu"], ["subtract+divide+multiply+subtract+add+relu"],
     None),
    # a chain ends after its activation: the add after the ReLU starts another
    (["mul", "relu", "add"], ["multiply+relu", "add"], None),
    # k / x does not fold, and a chain read by one TVM kernel alone (the divide, the sigmoid)
    # stays in it (FuseOps folds it there): nothing claimed
    (["rdiv"], [], None), (["mul", "add", "sigmoid"], [], None),
    # ... and the chain read only by a dropped chain is fused with it: one TVM kernel
    (["mul", "relu", "add", "sigmoid"], [], None),
    # a chain also read by the convolution is a kernel of its own either way: claimed, and so
    # is the one after it
    (["mul", "add", "relu"], ["multiply+add+relu"], 2),
    (["mul", "relu", "add"], ["multiply+relu", "add"], 1),
], ids=["every-link", "after-relu", "rdiv", "before-sigmoid", "dropped-reader",
        "sigmoid-beside-conv", "sigmoid-between-chains"])
def test_which_chains_are_claimed(links, claimed, sigmoid_of):
    res = _build_and_check(chain_onnx(links, sigmoid_of=sigmoid_of))
    assert [n.attrs["onednn_op"] for n in _affine(res)] == claimed
    if links[-1] == "sigmoid":
        (fused,) = [n.func_name for n in res.graph.nodes if "sigmoid" in (n.func_name or "")]
        assert "multiply" in fused and "add" in fused  # one TVM kernel
    kernels = [n for n in res.graph.nodes if n.op != "null"
               and not n.func_name.startswith(("hgrt.", "__"))]
    assert len(kernels) == (1 if "sigmoid" in links or sigmoid_of is not None or "rdiv" in links
                            else 0), [n.func_name for n in kernels]


@needs_onednn
def test_clip_ends_a_chain():
    x = relax.Var("x", relax.TensorType((1, 3, H, W), "float32"))
    ws = [relax.Var(n, relax.TensorType(s, "float32"))
          for n, s in (("e0", (5, 3, 1, 1)), ("e1", (6, 3, 1, 1)), ("k", (C, 1, 1)),
                       ("w", (4, C, 1, 1)))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *ws]):
        with bb.dataflow():
            cat = bb.emit(relax.op.concat([bb.emit(relax.op.nn.conv2d(x, ws[0])),
                                           bb.emit(relax.op.nn.conv2d(x, ws[1]))], axis=1))
            scaled = bb.emit(relax.op.multiply(cat, ws[2]))
            clipped = bb.emit(relax.op.clip(scaled, -0.5, 0.8))
            out = bb.emit_output(bb.emit(relax.op.nn.conv2d(clipped, ws[3])))
        bb.emit_func_output(out)
    mod = bb.finalize()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    rng = np.random.default_rng(0)
    params = {v.name: rng.standard_normal([int(d) for d in v.ty.shape]).astype("float32")
              for v in ws}
    xv = rng.standard_normal((1, 3, H, W)).astype("float32")
    res = hgrt.build(mod, ["cpu"], params=params, kernels="onednn")
    (node,) = _affine(res)
    assert node.attrs["onednn_op"] == "multiply+clip"
    want = reference(mod, [xv], params)[0]
    np.testing.assert_allclose(run_hgrt(res, {"x": xv})[0], want, **TOL)
    assert (np.abs(want) > 0).any()


@needs_onednn
def test_a_result_read_twice_ends_the_chain_there():
    res = _build_and_check(chain_onnx(["mul", "add", "relu"], also_output=0))
    assert [n.attrs["onednn_op"] for n in _affine(res)] == ["multiply", "add+relu"]


@needs_onednn
def test_what_does_not_fold_stays_a_tvm_kernel():
    # a divisor with a zero does not fold: the multiply before it fuses with it in TVM
    res = _build_and_check(chain_onnx(["mul", "div"], zero_divisor=True))
    assert _affine(res) == []
    assert any("multiply" in (n.func_name or "") and "divide" in n.func_name
               for n in res.graph.nodes)
    # one number per row (H), not per channel: not claimed (the tensor goes back to NCHW)
    res = _build_and_check(chain_onnx(["mul", "relu"], const_shape=(1, 1, H, 1)))
    assert _affine(res) == []


def test_tvm_kernels_claim_nothing():
    res = _build_and_check(chain_onnx(["bn", "mul", "add", "relu"]), kernels="tvm")
    assert _affine(res) == []


@needs_onednn
def test_the_profile_names_onednn_kernels_by_what_they_fuse():
    import tvm

    model = chain_onnx(["bn", "relu"])
    res = _build_and_check(model)
    m = hgrt.create(res.graph_json, res.lib, [tvm.cpu(0)])
    m.load_params(res.params)
    m.set_input(**onnx_inputs(model))
    rep = m.profile(repeat=2)
    by_op = rep.by_op()
    assert by_op["onednn multiply+add+relu"][0] == 1 and by_op["onednn concat"][0] == 1
    assert sum(n for n, _ in by_op.values()) == len(rep.ops)
    assert "onednn multiply+add+relu" in rep.table()
    ops = {e["args"]["op"] for e in rep.trace_events if e.get("ph") == "B"}
    assert "onednn multiply+add+relu" in ops
