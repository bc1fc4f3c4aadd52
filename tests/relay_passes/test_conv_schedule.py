"""Convolutions over a vector of output channels: true to each x86 ISA, weights prepacked at
build, same numbers as the Relax VM."""

import importlib
import re
import sys
import warnings

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import hgrt
from hgrt.devices import vector_isa
from hgrt.relay_passes.inner.cpu_schedule import schedule_cpu_functions
from hgrt.relay_passes.inner.prepack_weights import pack_output_channels
from hgrt.testing import reference, run_hgrt, run_lowered_vm

AVX2 = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}
AVX512 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}


def _runs_here(target: dict) -> bool:
    from hgrt.devices import cpu_flags

    need = {"avx2", "fma"} if vector_isa(tvm.target.Target(target)).name == "avx2" else {"avx512f"}
    return need <= cpu_flags()


def convs(width: int, stride: int = 1):
    """x (1, 8, width, width) -> 3x3 conv (16) -> relu -> 1x1 conv (32) + residual-free bias
    -> relu: a 3x3 with padding (a separate pad block) and a 1x1 (the pad inlined)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype("float32"), n) for n, s in (
        ("w1", (16, 8, 3, 3)), ("b1", (16,)), ("w2", (32, 16, 1, 1)), ("b2", (32,)))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
             helper.make_node("Relu", ["c2"], ["y"])]
    graph = helper.make_graph(
        nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                       [1, 8, width, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((1, 8, width, width)).astype("float32")
    return model, x


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("width, stride", [(13, 1), (19, 1), (20, 1), (28, 2)])
def test_convs_equal_the_vm_with_prepacked_weights(target, width, stride):
    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    isa = vector_isa(tvm.target.Target(target))
    lanes = isa.lanes()
    model, x = convs(width, stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
    # both weights stored packed, output channels innermost; the NCHW originals gone. The 1x1
    # over a plane of 128+ pixels that fill no whole tile of 16 takes the pointwise tile
    pixels = ((width - 1) // stride + 1) ** 2
    oc = isa.registers // 4 if pixels % 16 and pixels >= 128 else lanes
    packed = {k: v.shape for k, v in res.params.items() if "_oc" in k}
    assert sorted(packed.values()) == sorted([(16 // lanes, 8, 3, 3, lanes),
                                              (32 // oc, 16, 1, 1, oc)])
    assert not any(v.ndim == 4 and v.shape[0] in (16, 32) for v in res.params.values())
    got = run_hgrt(res, {"x": x})[0]
    np.testing.assert_allclose(got, reference(model, [x])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_convs_are_tiled_within_a_group(target, groups):
    """A grouped conv (alexnet's, 32 output channels per group at groups=2) gets the same
    tile, never across two groups (their inputs differ); packed weights, VM's numbers."""
    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    lanes = vector_isa(tvm.target.Target(target)).lanes()
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 16 // groups, 3, 3)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], group=groups),
         helper.make_node("Relu", ["c"], ["y"])], "gconv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((1, 16, 20, 20)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
    packed = [v.shape for k, v in res.params.items() if k.endswith(f"_oc{lanes}")]
    tiled = (64 // groups) % lanes == 0
    assert packed == ([(64 // lanes, 16 // groups, 3, 3, lanes)] if tiled else [])
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target, blocks, width, tile", [
    (AVX2, 4, 20, (2, 5)),  # two vectors x a row dividing the width, 2*5+3 of 16 registers
    (AVX2, 4, 14, (1, 7)),  # no divisor in 4..6: one vector x the whole row
    (AVX2, 3, 20, (1, 10)),  # odd channel blocks cannot pair
    (AVX512, 2, 14, (2, 7)),  # 32 registers: rows up to 7
    (AVX512, 2, 13, (1, 13)),
    (AVX512, 2, 56, (2, 7)),
])
def test_the_register_tile_fits_the_isa(target, blocks, width, tile):
    conv_tile = sys.modules["hgrt.relay_passes.inner.cpu_schedule_conv"]._conv_tile
    isa = vector_isa(tvm.target.Target(target))
    vectors, row = conv_tile(blocks, width, isa)
    assert (vectors, row) == tile
    assert vectors * row + vectors + 1 <= isa.registers  # accumulators, weights, a broadcast


def test_packing_puts_output_channels_innermost():
    w = np.arange(32 * 3 * 2 * 2, dtype="float32").reshape(32, 3, 2, 2)
    p = pack_output_channels(w, 8)
    assert p.shape == (4, 3, 2, 2, 8)
    for o, i, kh, kw in [(0, 0, 0, 0), (13, 2, 1, 0), (31, 1, 1, 1)]:
        assert p[o // 8, i, kh, kw, o % 8] == w[o, i, kh, kw]


def test_a_weight_that_is_not_constant_is_repacked_by_the_kernel():
    """A conv whose weight is an input of the model: the kernel keeps the NCHW parameter and
    packs it itself on each call (no prepacked parameter); same numbers as unscheduled."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 13, 13), "float32"))
    w = relax.Var("w", relax.TensorType((16, 8, 3, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.relu(relax.op.nn.conv2d(x, w, padding=1)))
        bb.emit_func_output(y)
    from hgrt.relay_passes.legalize_and_fuse import lowering_passes

    mod = bb.get()
    with tvm.transform.PassContext(opt_level=3):
        for p in lowering_passes():
            mod = p(mod)
    target = tvm.target.Target(AVX2 if _runs_here(AVX2) else {"kind": "llvm"})
    new, report = schedule_cpu_functions(mod, target, weights={})
    assert report.prepacked == {} and report.tiled
    rng = np.random.default_rng(1)
    args = [rng.standard_normal((1, 8, 13, 13)).astype("float32"),
            rng.standard_normal((16, 8, 3, 3)).astype("float32")]
    conv = next(f for gv, f in new.functions_items() if "conv" in gv.name_hint)
    if vector_isa(target).name == "avx2":
        assert "w_global" in conv.script()  # the kernel's own packed copy
    np.testing.assert_allclose(run_lowered_vm(new, args, target)[0],
                               run_lowered_vm(mod, args, "llvm")[0], rtol=1e-5, atol=1e-5)


def test_the_lowered_module_with_packed_weights_runs_on_the_relax_vm():
    """``lower_model(schedule=True)`` (what benchmarks hand to the VM) stays a well-typed Relax
    module once weights are packed: the packed kernels' signatures and main's calls agree."""
    from hgrt.compiler import lower_model

    model, x = convs(13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, weights = lower_model(model, "cpu", schedule=True)
    relax.analysis.well_formed(mod)
    main = mod["main"]
    n_in = int(main.attrs["num_input"])
    assert any("_oc" in p.name for p in main.params[n_in:])
    got = run_lowered_vm(mod, [x] + [weights[p.name] for p in main.params[n_in:]])[0]
    np.testing.assert_allclose(got, reference(model, [x])[0], rtol=1e-4, atol=1e-4)


def _conv_model(channels: int, width: int, kernel: int, stride: int, groups: int):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, channels // groups, kernel, kernel)).astype("float32") * 0.1
    pad = kernel // 2
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[pad] * 4, strides=[stride] * 2,
                          group=groups),
         helper.make_node("Relu", ["c"], ["y"])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, width, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model, rng.standard_normal((1, channels, width, width)).astype("float32")


@pytest.mark.parametrize("channels, width, kernel, stride, groups, staged", [
    (64, 32, 1, 1, 1, True),  # a 4 KB plane, 64 rows per tile
    (32, 30, 3, 1, 1, True),  # padded: the pad block moves into the parallel loop
    (64, 33, 3, 2, 2, True),  # strided, two groups, odd width
    (64, 14, 3, 1, 1, False),  # a 784-byte plane: rows are near each other already
    (16, 56, 3, 1, 1, False),  # 48 rows per tile
    (32, 40, 5, 1, 1, False),  # a 5x5 window
])
def test_large_planes_are_read_through_staged_rows(channels, width, kernel, stride, groups,
                                                    staged):
    """Where a convolution's input planes are large, each parallel iteration copies the input
    rows it reads (padding included) into a buffer of its own, allocated inside the parallel
    loop (one per thread); the numbers stay the Relax VM's."""
    from hgrt.compiler import lower_model

    model, x = _conv_model(channels, width, kernel, stride, groups)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm")
        mod, _ = lower_model(model, "cpu", schedule=True)
    text = next(f for gv, f in mod.functions_items() if "conv" in gv.name_hint).script()
    assert ("hgrt_staged_rows" in text) == staged
    if staged:  # the staged copy is written inside the parallel loop, not before it
        assert text.index("T.parallel") < text.index("hgrt_staged_rows")
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, dropout", [(40, False), (64, True)])
def test_dense_weights_are_packed_by_column_tile(n, dropout):
    """A dense layer's weight ``(K, N)`` is stored as ``(N / vf, K, vf)``: each vector tile's
    columns contiguous (unpacked, every step of the reduction read a row away). A dropout
    after it (alexnet's: the kernel has two outputs) keeps working. The VM's numbers."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((n, 96)).astype("float32")
    nodes = [helper.make_node("Gemm", ["x", "w"], ["g"], transB=1)]
    nodes += [helper.make_node("Dropout", ["g"], ["y"])] if dropout else \
        [helper.make_node("Relu", ["g"], ["y"])]
    graph = helper.make_graph(
        nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 96])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((1, 96)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm")
        want = reference(model, [x])[0]
    packed = [(k, v.shape) for k, v in res.params.items() if "_col" in k]
    assert len(packed) == 1, res.params.keys()
    name, (tiles, k, vf) = packed[0]
    assert k == 96 and tiles * vf == n and name.endswith(f"_col{vf}")
    assert not any(v.shape in ((96, n), (n, 96)) for v in res.params.values())
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], want, rtol=1e-5, atol=1e-5)


def _pointwise_model(channels: int, out: int, width: int, stride: int):
    """x -> 1x1 conv (+ bias) -> + r (a residual input) -> relu."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((out, channels, 1, 1)).astype("float32") * 0.2
    b = rng.standard_normal(out).astype("float32")
    side = (width - 1) // stride + 1
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride] * 2),
         helper.make_node("Add", ["c", "r"], ["s"]),
         helper.make_node("Relu", ["s"], ["y"])], "pointwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, width, width]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, out, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model, {"x": rng.standard_normal((1, channels, width, width)).astype("float32"),
                   "r": rng.standard_normal((1, out, side, side)).astype("float32")}


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("channels, out, width, stride, pointwise", [
    (32, 48, 32, 1, True),  # 1024 pixels: two vectors of them per tile
    (16, 24, 28, 1, True),  # 784 pixels: one vector of 16 (AVX-512), two of 8 (AVX2)
    (32, 32, 27, 1, True),  # 729 pixels fill no whole vectors: a padded plane, last tile peeled
    (16, 40, 13, 1, True),  # 169 pixels; 40 channels fill no pair of AVX-512 channel vectors
    (256, 32, 14, 1, False),  # 196 pixels, but 256 input channels: the channel-vector tile
    (32, 32, 7, 1, False),  # 49 pixels: too few for whole tiles
    (32, 32, 16, 1, False),  # a 1 KB plane
    (32, 32, 56, 2, False),  # strided
])
def test_pointwise_convs_are_a_matrix_product(target, channels, out, width, stride, pointwise):
    """A 1x1 stride-1 convolution over a large plane is tiled as the matrix product it is in
    NCHW: a few output channels (its weight packed with that many innermost) x vectors of
    consecutive pixels, the bias, residual add and relu on the tile's write-back; the VM's
    numbers. Others keep the output-channel vector tile (``_oc<lanes>``)."""
    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    isa = vector_isa(tvm.target.Target(target))
    model, inputs = _pointwise_model(channels, out, width, stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
        want = reference(model, [inputs["x"], inputs["r"]])[0]
    packed = [(k, v.shape) for k, v in res.params.items() if "_oc" in k]
    assert len(packed) == 1, res.params.keys()
    name, shape = packed[0]
    rows = max(d for d in range(1, isa.registers // 4 + 1) if out % d == 0)
    lanes = rows if pointwise else isa.lanes()
    assert name.endswith(f"_oc{lanes}") and shape == (out // lanes, channels, 1, 1, lanes)
    np.testing.assert_allclose(run_hgrt(res, inputs)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("channels, out, width, outer", [
    (512, 996, 13, True),  # as squeezenet's classifier: 2 MB of weights over a 346 KB plane
    (168, 1600, 28, True),  # 1.03 MiB over 527 KB, a plane of whole vectors
    (64, 996, 13, False),  # 255 KB of weights: tiles of pixels in parallel
    (512, 1000, 28, False),  # 2 MB over 1.6 MB: tiles of pixels in parallel
])
def test_pointwise_convs_with_large_weights_read_each_weight_once(target, channels, out,
                                                                  width, outer):
    """A pointwise convolution whose weight is 1 MiB or more and twice its input plane runs
    its groups of output channels in parallel, each over every tile of pixels of a plane
    staged once (so each weight is read once, not once per tile); smaller weights keep the
    tiles of pixels in parallel. The VM's numbers either way."""
    from tvm import s_tir

    from hgrt.compiler import lower_model
    from hgrt.relay_passes.inner.cpu_schedule import default_schedule_trace

    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    tgt = tvm.target.Target(target)
    isa = vector_isa(tgt)
    rng = np.random.default_rng(13)
    w = rng.standard_normal((out, channels, 1, 1)).astype("float32") * 0.1
    b = rng.standard_normal(out).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
         helper.make_node("Relu", ["c"], ["y"])], "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, width, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((1, channels, width, width)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
        mod, _ = lower_model(model, "cpu", schedule=False)
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-4, atol=1e-4)
    rows = max(d for d in range(1, isa.registers // 4 + 1) if out % d == 0)
    assert any(k.endswith(f"_oc{rows}") for k in res.params), res.params.keys()
    func = next(f for gv, f in mod.functions_items() if "conv" in gv.name_hint)
    replay = s_tir.Schedule(func.with_attr("target", tgt))
    default_schedule_trace(func.with_attr("target", tgt), tgt).apply_to_schedule(
        replay, remove_postproc=False)
    pixels = width * width
    vf = 2 * isa.lanes() if pixels % (2 * isa.lanes()) == 0 else isa.lanes()
    if pixels % vf:
        vf = max(vf, 16)  # a ragged plane: tiles of 64 bytes
    tiles = -(-pixels // vf)
    parallel = {int(n) for n in re.findall(r"T\.parallel\((?:T\.int64\()?(\d+)",
                                           replay.mod.script())}
    assert (out // rows in parallel) == outer and (tiles in parallel) == (not outer), parallel


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("width", [27, 32])
def test_a_pointwise_conv_that_writes_the_result_flattens_a_copy(target, width):
    """A bare 1x1 convolution (no bias, no epilogue: it writes the kernel's result, whose
    layout is the caller's) still takes the pointwise tile over a flattened copy; and the
    default schedule's trace (what ``hgrt tune`` records) replays to the same kernel."""
    from tvm import s_tir

    from hgrt.compiler import lower_model
    from hgrt.relay_passes.inner.cpu_schedule import default_schedule_trace

    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    rng = np.random.default_rng(9)
    w = rng.standard_normal((32, 16, 1, 1)).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])], "bare",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, width, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((1, 16, width, width)).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
        mod, _ = lower_model(model, "cpu", schedule=False)
    rows = vector_isa(tvm.target.Target(target)).registers // 4
    assert any(k.endswith(f"_oc{rows}") for k in res.params), res.params.keys()
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-4, atol=1e-4)
    func = next(f for gv, f in mod.functions_items() if "conv" in gv.name_hint)
    func = func.with_attr("target", tvm.target.Target(target))
    trace = default_schedule_trace(func, tvm.target.Target(target))
    assert trace is not None and "pad_einsum" in str(trace) if width == 27 else True
    replay = s_tir.Schedule(func)
    trace.apply_to_schedule(replay, remove_postproc=False)
    cpu_schedule = importlib.import_module("hgrt.relay_passes.inner.cpu_schedule")
    tgt = tvm.target.Target(target)
    direct, _, _ = cpu_schedule._default_schedule(func, vector_isa(tgt), cpu_schedule._cores(tgt))
    tvm.ir.assert_structural_equal(replay.mod, direct.mod)


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("channels, width, batch", [
    (272, 14, 1),  # 68 channels per group, 196 pixels: the last tile peeled
    (136, 28, 1),  # 34 per group, 784 pixels: whole tiles
    (544, 7, 1),  # 136 per group: whole AVX2 vectors of channels, not AVX-512 ones
    (136, 13, 2),  # two images: the tile loop runs over both (no peel), still the VM's numbers
    (48, 28, 1),  # 12 input channels per group: too few, the generic schedule (no packing)
])
def test_grouped_pointwise_convs_are_a_matrix_product_per_group(target, channels, width,
                                                                 batch):
    """ShuffleNet's grouped 1x1 convolutions (4 groups) whose groups are no whole vectors of
    channels, which the channel-vector tile cannot take, are a matrix product per group: a few
    output channels of one group x vectors of pixels (weight packed ``_oc<rows>``); where a
    group is whole vectors, the channel-vector tile stays (``_oc<lanes>``)."""
    from hgrt.compiler import lower_model
    from hgrt.relay_passes.inner.cpu_schedule import default_schedule_trace
    from hgrt.relay_passes.inner.cpu_schedule_conv import PEEL_HINT

    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    isa = vector_isa(tvm.target.Target(target))
    groups, per_group = 4, channels // 4
    rng = np.random.default_rng(11)
    w = rng.standard_normal((channels, per_group, 1, 1)).astype("float32") * 0.2
    b = rng.standard_normal(channels).astype("float32")
    shape = [batch, channels, width, width]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=groups),
         helper.make_node("Relu", ["c"], ["y"])], "gpointwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal(shape).astype("float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
        mod, _ = lower_model(model, "cpu", schedule=False)
    pointwise = per_group % isa.lanes() != 0 and per_group >= 16
    rows = max(d for d in range(1, isa.registers // 4 + 1) if per_group % d == 0)
    oc = rows if pointwise else isa.lanes()
    packed = [(k, v.shape) for k, v in res.params.items() if "_oc" in k]
    if pointwise or per_group % isa.lanes() == 0:
        assert packed == [(packed[0][0], (channels // oc, per_group, 1, 1, oc))], packed
        assert packed[0][0].endswith(f"_oc{oc}")
    else:
        assert packed == []
    np.testing.assert_allclose(run_hgrt(res, {"x": x})[0], reference(model, [x])[0],
                               rtol=1e-4, atol=1e-4)
    func = next(f for gv, f in mod.functions_items() if "conv" in gv.name_hint)
    trace = default_schedule_trace(func.with_attr("target", tvm.target.Target(target)),
                                   tvm.target.Target(target))
    vf = 2 * isa.lanes() if width * width % (2 * isa.lanes()) == 0 else isa.lanes()
    assert (PEEL_HINT in str(trace)) == (pointwise and width * width % vf != 0)


def _depthwise_model(channels: int, width: int, kernel: int, stride: int):
    """A depthwise convolution (a group per channel) + bias, SiLU: MobileNet's and
    EfficientNet's."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 1, kernel, kernel)) * 0.3)
                                     .astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal(channels).astype("float32"), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=channels,
                              kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4,
                              strides=[stride, stride]),
             helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    graph = helper.make_graph(
        nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                    [1, channels, width, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return model, rng.standard_normal((1, channels, width, width)).astype("float32")


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("channels, width, kernel, stride", [
    (24, 7, 5, 1),    # rows of no whole vector: the epilogue over the plane's pixels
    (16, 14, 3, 1),
    (8, 72, 3, 1),    # a plane over MAX_PLANE_EPILOGUE: the epilogue per row, its tail peeled
    (16, 28, 3, 2),   # stride 2
    (8, 4, 3, 1)])    # a row shorter than a vector
def test_depthwise_convs_get_their_rule_and_onnxruntime_s_numbers(target, channels, width,
                                                                   kernel, stride):
    """Each depthwise convolution gets the depthwise rule (a channel's padded plane staged on
    its thread, rows of pixels in vectors), not the generic tile, and right against the ONNX
    oracle on this host."""
    from hgrt.testing import fused_module

    model, x = _depthwise_model(channels, width, kernel, stride)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod, _ = fused_module(model)
    mod = tvm.IRModule({gv: f.with_attr("target", tvm.target.Target(target))
                        if isinstance(f, tvm.tirx.PrimFunc) else f
                        for gv, f in mod.functions.items()})
    new, report = schedule_cpu_functions(mod, tvm.target.Target(target))
    (name,) = [n for n in report.rules if "conv2d" in n]
    assert report.rules[name] == ["conv"], report.rules
    assert "hgrt_staged_rows" in new[name].script()
    if not _runs_here(target):
        pytest.skip(f"this CPU cannot run {target['mcpu']} code")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, ["cpu"], kernels="tvm", target={"cpu": target})
    got = run_hgrt(res, {"x": x})[0]
    np.testing.assert_allclose(got, reference(model, [x])[0], rtol=1e-5, atol=1e-5)
