"""oneDNN's kernels between a transformer's dense layers (providers/onednn/rows.py and
onednn_rows.cc): a layer norm and a softmax over the last axis, the matmul of two activations
with an add after it; the kernels against numpy, an attention block against onnxruntime, and
bad arguments refused with a message."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

import hgrt
from hgrt.providers.onednn import kernels as onednn
from hgrt.providers.onednn import rows
from hgrt.testing import assert_close_to, reference, run_hgrt

REASON = onednn.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"oneDNN unavailable: {REASON}")


def _call(kind: str, *arrays: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    f = onednn.kernel_function(rows.FUNC_NAME[kind])
    f(*[tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays], out)
    return out.numpy()


def test_the_layer_norm_kernel_is_numpy_s():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 9, 48)).astype("float32") * 3 + 1
    scale, shift = rng.standard_normal((2, 48)).astype("float32")
    got = _call("layer_norm", x, np.concatenate([scale, shift, [1e-5]]).astype("float32"),
                out_shape=x.shape)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, want * scale + shift, rtol=1e-4, atol=1e-4)


def test_the_softmax_kernel_is_numpy_s_with_nans_replaced_where_asked():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 33)).astype("float32") * 4
    x[1, 2] = -np.inf  # a row masked whole: NaN, as ONNX's softmax gives it
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(-1, keepdims=True))
        want = e / e.sum(-1, keepdims=True)
    plain = _call("softmax", x, np.array([0, 0], "float32"), out_shape=x.shape)
    assert np.isnan(plain[1, 2]).all()
    got = _call("softmax", x, np.array([1, 0.25], "float32"), out_shape=x.shape)
    assert (got[1, 2] == 0.25).all()
    want[1, 2] = 0.25
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a_shape,b_shape,d_shape", [
    ((1, 4, 7, 8), (4, 8, 7), None),  # a lower rank broadcasts
    ((2, 1, 7, 8), (1, 3, 8, 5), (1, 1, 7, 5)),  # both batch dims broadcast, an addend
    ((6, 8), (8, 9), (9,)),
])
def test_the_matmul_kernel_is_numpy_s(a_shape, b_shape, d_shape):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(a_shape).astype("float32")
    b = rng.standard_normal(b_shape).astype("float32")
    want = np.matmul(a, b)
    args = [a, b]
    if d_shape is not None:
        d = rng.standard_normal(d_shape).astype("float32")
        want, args = want + d, [a, b, d]
    np.testing.assert_allclose(_call("matmul", *args, out_shape=want.shape), want,
                               rtol=1e-5, atol=1e-5)


def _views(*views: tuple[tuple[int, ...], tuple[int, ...]], scale: float = 1.0) -> np.ndarray:
    """The matmul kernel's views: each (dims, strides), then the scale's float32 bits."""
    bits = int(np.array(scale, "float32").view("uint32"))
    return np.array([x for d, st in views for x in (*d, *st)] + [bits], "int64")


def test_the_matmul_kernel_reads_and_writes_transposed_tensors_through_views():
    """a and b stored as attention holds them before its heads are split off (sequence,
    heads, head dim), the product scaled and written with its heads merged back: numpy's
    transposes."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 7, 4, 8)).astype("float32")  # read as (2, 4, 7, 8)
    b = rng.standard_normal((2, 5, 4, 8)).astype("float32")  # read as (2, 4, 8, 5)
    want = np.matmul(a.transpose(0, 2, 1, 3), b.transpose(0, 2, 3, 1))
    views = _views(((2, 4, 7, 8), (224, 8, 32, 1)), ((2, 4, 8, 5), (160, 8, 1, 32)),
                   ((2, 4, 7, 5), (140, 5, 20, 1)), scale=0.25)
    got = _call("matmul", a, b, views, out_shape=(2, 7, 4, 5))
    np.testing.assert_allclose(got, (want * 0.25).transpose(0, 2, 1, 3), rtol=1e-5, atol=1e-5)
    d = rng.standard_normal((1, 4, 7, 5)).astype("float32")  # an addend on the product
    got = _call("matmul", a, b, d, views, out_shape=(2, 7, 4, 5))
    np.testing.assert_allclose(got, (want * 0.25 + d).transpose(0, 2, 1, 3), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="view of b reads past its 320 elements"):
        _call("matmul", a, b, _views(((2, 4, 7, 8), (224, 8, 32, 1)),
                                     ((2, 4, 8, 5), (160, 8, 1, 33)),
                                     ((2, 4, 7, 5), (140, 5, 20, 1))), out_shape=(2, 7, 4, 5))
    with pytest.raises(ValueError, match="view of the output does not cover it once"):
        _call("matmul", a, b, _views(((2, 4, 7, 8), (224, 8, 32, 1)),
                                     ((2, 4, 8, 5), (160, 8, 1, 32)),
                                     ((2, 4, 7, 5), (140, 5, 10, 1))), out_shape=(2, 7, 4, 5))
    with pytest.raises(ValueError, match="views has 8 elements"):
        _call("matmul", a, b, views[:8], out_shape=(2, 7, 4, 5))


def test_bad_arguments_are_refused_with_what_is_wrong():
    x = np.zeros((4, 8), "float32")
    with pytest.raises(ValueError, match="layer norm parameters"):
        _call("layer_norm", x, np.zeros(3, "float32"), out_shape=x.shape)
    with pytest.raises(ValueError, match="bad epsilon"):
        _call("layer_norm", x, np.array([1] * 16 + [-1], "float32"), out_shape=x.shape)
    with pytest.raises(ValueError, match="one shape"):
        _call("softmax", x, np.zeros(2, "float32"), out_shape=(8, 4))
    with pytest.raises(ValueError, match="softmax: bad parameters"):
        _call("softmax", x, np.array([3, 0], "float32"), out_shape=x.shape)
    with pytest.raises(ValueError, match="do not fit"):
        _call("matmul", x, np.zeros((7, 5), "float32"), out_shape=(4, 5))
    with pytest.raises(ValueError, match="matmul operand a must be contiguous float32"):
        _call("matmul", x.astype("float64"), np.zeros((8, 5), "float32"), out_shape=(4, 5))


def attention(seq: int = 12, dim: int = 32, heads: int = 4, masked_row: bool = True,
              flat: bool = False):
    """A transformer block's attention as torch.onnx writes it: a layer norm, Q, K, V by
    constant weights, the scores QK^T (two activations) plus a mask, a softmax with
    where(isnan) after it, its product with V, the heads merged and projected. ``flat``: the
    products 3-D, the heads (of one sample) as the batch axis, reshaped there and back, K
    transposed for its product apart (as the dynamo exporter writes ViT's), the scores divided
    by the scale's inverse after their product (as GPT-2 does)."""
    rng = np.random.default_rng(3)
    hd = dim // heads
    mask = np.where(np.arange(seq)[None, :] <= np.arange(seq)[:, None], 0.0, -1e9)[None, None]
    if masked_row:
        mask[0, 0, 3] = -np.inf  # a query that sees nothing: NaN, then 0
    mask = mask[0] if flat else mask  # (of the 3-D scores' rank)
    inits = [numpy_helper.from_array(np.asarray(v, "float32"), n) for n, v in {
        "g": rng.uniform(0.5, 1.5, dim), "be": rng.standard_normal(dim) * 0.1,
        **{w: rng.standard_normal((dim, dim)) / np.sqrt(dim) for w in ("wq", "wk", "wv", "wo")},
        "mask": mask, "zero": 0.0, "scale": 1 / np.sqrt(hd), "root": np.sqrt(hd)}.items()]
    inits.append(numpy_helper.from_array(np.array([1, seq, heads, hd], "int64"), "split"))
    inits.append(numpy_helper.from_array(np.array([1, seq, dim], "int64"), "merge"))
    n = helper.make_node
    nodes = [n("LayerNormalization", ["x", "g", "be"], ["ln"], axis=-1, epsilon=1e-5)]
    inits.append(numpy_helper.from_array(np.array([heads, seq, hd], "int64"), "flat"))
    inits.append(numpy_helper.from_array(np.array([1, heads, seq, hd], "int64"), "unflat"))
    for h in ("q", "k", "v"):
        nodes += [n("MatMul", ["ln", f"w{h}"], [f"{h}0"]),
                  n("Reshape", [f"{h}0", "split"], [f"{h}1"])]
        if flat:
            nodes += [n("Transpose", [f"{h}1"], [f"{h}2"], perm=[0, 2, 1, 3]),
                      n("Reshape", [f"{h}2", "flat"], [f"{h}3"])]
            nodes += [n("Transpose", ["k3"], ["k"], perm=[0, 2, 1])] if h == "k" else \
                [n("Identity", [f"{h}3"], [h])]
        else:
            nodes.append(n("Transpose", [f"{h}1"], [h],
                           perm=[0, 2, 3, 1] if h == "k" else [0, 2, 1, 3]))
    if flat:
        nodes += [n("MatMul", ["q", "k"], ["sq"]), n("Div", ["sq", "root"], ["s0"])]
    else:
        nodes += [n("Mul", ["q", "scale"], ["qs"]), n("MatMul", ["qs", "k"], ["s0"])]
    nodes += [n("Add", ["s0", "mask"], ["s1"]), n("Softmax", ["s1"], ["p0"], axis=-1),
              n("IsNaN", ["p0"], ["nan"]), n("Where", ["nan", "zero", "p0"], ["p"]),
              n("MatMul", ["p", "v"], ["o0" if not flat else "of"])]
    if flat:
        nodes.append(n("Reshape", ["of", "unflat"], ["o0"]))
    nodes += [n("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
              n("Reshape", ["o1", "merge"], ["o2"]), n("MatMul", ["o2", "wo"], ["y"])]
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _build(model, kernels: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, ["cpu"], kernels=kernels)


@pytest.mark.parametrize("flat", [False, True])
def test_an_attention_block_runs_on_the_row_kernels_as_onnxruntime_does(flat):
    model = attention(flat=flat)
    x = {"x": np.random.default_rng(4).standard_normal((1, 12, 32)).astype("float32")}
    res = _build(model, "onednn")
    ops = sorted(n.attrs.get("onednn_op", "") for n in res.graph.nodes
                 if n.func_name in rows.FUNC_NAME.values())
    # (flat: the mask broadcasts over the heads, which oneDNN's fast kernels do not take as a
    # post-op: it stays an add of its own)
    scores = "matmul+scale+views" if flat else "matmul+add+views"
    assert ops == sorted(["layer_norm", scores, "matmul+views", "softmax+nan_to"])
    # Q, K and V are read through strides where the dense layers wrote them (Q's scale a
    # post-op), the product with V written with its heads merged: no TVM kernel is left but
    # the reshapes, which are views (and flat's add)
    tvm_kernels = [f for f in (n.func_name for n in res.graph.nodes)
                   if f and not f.startswith("hgrt.") and f != "__nop"]
    assert len(tvm_kernels) == flat and all("add" in k for k in tvm_kernels), tvm_kernels
    want = reference(model, x)
    assert np.isfinite(want[0]).all()
    assert_close_to(run_hgrt(res, x), want)
    tvm_only = _build(model, "tvm")
    assert not [n for n in tvm_only.graph.nodes if n.func_name in rows.FUNC_NAME.values()]
    assert_close_to(run_hgrt(tvm_only, x), want)


def test_row_kernels_called_from_threads_at_once_give_one_run_s_bits():
    """The kernels' primitives and argument handles are shared by callers: four threads
    running the block at once give, bit for bit, what one run at the same thread count gave."""
    model = attention(seq=64, dim=64)
    res = _build(model, "onednn")
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((1, 64, 64)).astype("float32")} for _ in range(4)]
    alone = [run_hgrt(res, f)[0] for f in feeds]
    got: dict[int, list[np.ndarray]] = {}

    def work(i: int) -> None:
        got[i] = [run_hgrt(res, feeds[i])[0] for _ in range(5)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert all(np.array_equal(r, alone[i]) for r in got[i])


def test_a_small_model_s_row_ops_stay_tvm_s_under_the_size_floor():
    """An attention block of a few thousand multiply-adds: below ``AUTO_MIN_MACS`` a oneDNN
    call's own cost outweighs the work, and ``"auto"`` leaves its row ops to TVM as it does its
    dense layers (the placement report says so)."""
    res = _build(attention(seq=4, dim=8, heads=2), "auto")
    assert not [n for n in res.graph.nodes if n.attrs.get("provider") == "onednn"]
    why = [r.kernels_why for r in res.placement_report if r.op == "relax.nn.softmax"]
    assert why and all(w.startswith("size floor") for w in why), why


def test_modules_made_and_dropped_over_and_over_stay_flat():
    """Fifteen modules of an attention block and of an int8 QDQ convolution, each made, run and
    dropped: the kernels' caches return to where they started (the int8 blob's entry goes with
    its module; the row kernels' primitives are one per shape) and the process's memory stays
    within a few MiB of where it was after the first ones."""
    import gc
    import sys

    import psutil

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from test_onednn_qdq import _relu_grid_convolution  # noqa: E402

    models = [(attention(seq=32, dim=64), "x", (1, 32, 64)),
              (_relu_grid_convolution(), "x", (1, 32, 14, 14))]
    built = [(_build(m, "onednn"), name, shape) for m, name, shape in models]
    cached = tvm.get_global_func("hgrt.onednn.cached_entries")
    rng = np.random.default_rng(6)

    def cycle() -> None:
        for res, name, shape in built:
            run_hgrt(res, {name: rng.standard_normal(shape).astype("float32")})

    for _ in range(5):
        cycle()
    gc.collect()
    tvm.get_global_func("hgrt.onednn.forget")(0, 2**63 - 1)
    cycle()
    gc.collect()
    entries, rss = cached(), psutil.Process().memory_info().rss
    for _ in range(15):
        cycle()
    gc.collect()
    assert cached() == entries
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB more after 15 cycles"


@pytest.mark.parametrize("seq,dim,heads", [(197, 256, 4), (193, 32, 2)])
def test_auto_leaves_matmuls_of_two_activations_to_tvm_where_its_tiles_hold_several_rows(
        seq, dim, heads):
    """On AVX-512 (built for 2 cores) TVM's matmul of two activations tiles several rows, rows
    that no tile divides included (197: tiles of 8 and a part-filled last one), and is modelled
    as fast as oneDNN's, as is its softmax over rows of no whole vectors: "auto" leaves the
    block to TVM (a oneDNN call costs ``ONEDNN_CALL_US`` more). With one row a tile (the scores
    times V of 193 rows, a prime, and 16 columns a head, over 2 heads: too few column tiles to
    share the rows out) TVM's is modelled slower (``ROW_TVM_SLOWDOWN``) and oneDNN takes it.
    The numbers are onnxruntime's."""
    from hgrt.devices.host_cpu import cpu_flags
    from hgrt.relay_passes.inner.cpu_schedule_matmul import tile_rows

    model = attention(seq=seq, dim=dim, heads=heads, masked_row=False, flat=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="auto",
                         target={"cpu": "llvm -mcpu=znver4 -num-cores=2"})
    isa = hgrt.devices.vector_isa(tvm.target.Target(res.targets["cpu:0"]))
    one_row = tile_rows(seq, dim // heads, isa, heads, 2) <= 1
    assert one_row == (seq == 193)
    ops = [n.attrs.get("onednn_op", "") for n in res.graph.nodes
           if n.func_name in rows.FUNC_NAME.values()]
    matmuls = [op for op in ops if op.startswith("matmul")]
    assert bool(matmuls) == one_row, ops
    if "avx512f" in cpu_flags():  # (the build's code runs here)
        x = {"x": np.random.default_rng(6).standard_normal((1, seq, dim)).astype("float32")}
        assert_close_to(run_hgrt(res, x), reference(model, x))
