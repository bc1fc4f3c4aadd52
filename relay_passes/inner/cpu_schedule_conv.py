"""The register tiles of hgrt's default CPU schedule for NCHW convolutions (``cpu_schedule``
tries them first on every convolution block):

- ``schedule_conv``: a vector of output channels x a row of output pixels (a broadcast input
  value each), the input rows of large planes staged contiguously first (padding included),
  the weights read with the channels innermost (prepacked at build when they are a weight of
  the model, ``prepack_weights``);
- ``schedule_pointwise``: a 1x1 stride-1 convolution over a large plane as the matrix product
  it is in NCHW (output channels x vectors of consecutive pixels), a plane that fills no whole
  vectors padded to whole vectors with its last tile peeled off at lowering
  (``peel_ragged_tiles``), a grouped one whose groups are no whole vectors per group;
- ``schedule_depthwise``: a depthwise convolution (one input channel a group) over rows of
  output pixels in vectors, channels in parallel, each padded plane staged on its thread.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from hgrt.devices import VectorISA
from hgrt.relay_passes.inner.cpu_schedule_blocks import (
    divisors,
    inline_epilogue,
    iter_loops,
    param_position,
    uses,
)

# a convolution reads input planes of this many bytes or more through staged rows: 28x28
# float32 planes and up (_staging_pays)
MIN_STAGED_PLANE = 3072
STAGED = "hgrt_staged_rows"  # block annotation of a staged copy
# a 1x1 convolution over a plane that fills no whole vectors takes the pointwise tile
# (_ragged_pointwise) over this many vectors of pixels or more, when it reads this many input
# channels or fewer, or has output channels the channel-vector tile cannot take
MIN_RAGGED_VECTORS = 8
MAX_RAGGED_CHANNELS = 128
# the largest output plane (bytes, float32) whose depthwise sums are kept whole before their
# epilogue runs over the plane (schedule_depthwise)
MAX_PLANE_EPILOGUE = 16 << 10
# a loop annotation that makes TVM's LoopPartition peel the iterations where a condition
# inside changes (peel_ragged_tiles)
PEEL_HINT = "pragma_loop_partition_hint"
# a pointwise convolution whose weight has this many bytes or more, and twice its input
# plane's, runs its groups of output channels in parallel, each over every tile of pixels (the
# plane staged once): with tiles of pixels in parallel, every tile read the whole weight from
# L3. Per kernel (AVX-512, 2 threads), weight / plane bytes: squeezenet's classifier conv
# (2 MB over 13x13, 5.9x) 690 -> 530 us, 4 MB over 14x14 (5x) 1.51 -> 1.28 ms, 2.8x 8 %
# faster, 2.1x equal, 1.25x 5-10 % slower; squeezenet's 4-256 KB ones 1.0-4x slower
MIN_CHANNELS_OUTER_BYTES = 1 << 20
# input channels per group below which a grouped 1x1 convolution keeps the generic schedule:
# ShuffleNet's first (6 per group, 3136 pixels) ran 88 vs 66 us in the model as a matrix
# product (27 vs 62 us alone, caches warm)
MIN_GROUP_INPUTS = 16


def _group_index(expr: tirx.Expr, f: tirx.Var, rc: tirx.Var) -> int | None:
    """``per_group`` when ``expr`` is a grouped convolution's input channel
    ``f // per_group * in_per_group + rc`` (a depthwise one's is ``f + rc``: 1), else None."""
    if isinstance(expr, tirx.Add) and expr.a.same_as(f) and expr.b.same_as(rc):
        return 1
    if not (isinstance(expr, tirx.Add) and expr.b.same_as(rc) and isinstance(expr.a, tirx.Mul)
            and isinstance(expr.a.b, tirx.IntImm)):
        return None
    div = expr.a.a
    if isinstance(div, tirx.FloorDiv) and div.a.same_as(f) and isinstance(div.b, tirx.IntImm):
        return int(div.b.value)
    return None


def _conv_parts(sch: s_tir.Schedule, block_rv) -> tuple[list, int, int | None] | None:
    """``(loops, weight read index, output channels per group)`` of a plain NCHW convolution
    block (``conv2d_nchw``: n, f, y, x spatial; rc, ry, rx reductions; weights read as
    ``w[f, rc, ry, rx]``, the data never by ``f``; None per group) or a grouped one
    (``group_conv2d_nchw``: the data's channel ``f // per_group * in_per_group + rc``), else
    None."""
    block = sch.get(block_rv)
    info = iter_loops(sch, block_rv)
    if (block.name_hint not in ("conv2d_nchw", "group_conv2d_nchw") or info is None
            or len(block.reads) != 2 or "".join(k for k, _, _, _ in info) != "SSSSRRR"):
        return None
    var = [v for _, v, _, _ in info]
    region = block.writes[0].region
    if len(region) != 4 or not all(r.min.same_as(v) for r, v in zip(region, var[:4],
                                                                      strict=True)):
        return None
    weight, per_group = None, None
    for i, r in enumerate(block.reads):
        idx = [x.min for x in r.region]
        if len(idx) == 4 and all(e.same_as(v) for e, v in zip(idx, [var[1], *var[4:]],
                                                                strict=True)):
            weight = i
        elif block.name_hint == "group_conv2d_nchw" and len(idx) == 4:
            per_group = _group_index(idx[1], var[1], var[4])
            if per_group is None or any(uses(e, var[1]) for j, e in enumerate(idx) if j != 1):
                return None
        elif any(uses(e, var[1]) for e in idx):
            return None
    if weight is None or block.name_hint == "group_conv2d_nchw" and per_group is None:
        return None
    return info, weight, per_group


def _pixel_row(width: int, isa: VectorISA) -> int:
    """Output pixels per register row: the largest divisor of ``width`` that fits the
    accumulators (one vector register each, three registers left for the weights and the
    broadcast pixel) and is at least 6; the whole row when it fits; else 8 with a ragged last
    tile (a predicate on the row, cheaper than no tile)."""
    cap = min(isa.registers - 3, 14)
    if width <= cap:
        return width
    fits = [d for d in divisors(width) if 6 <= d <= cap]
    return max(fits) if fits else 8


def _conv_tile(blocks: int, width: int, isa: VectorISA) -> tuple[int, int]:
    """``(vectors, pixels)`` of a convolution's register tile: two vectors of output channels
    × a row of pixels that divides the output width (4 to 6 pixels with 16 registers, 4 to 7
    with 32: each pixel's broadcast feeds two multiply-adds, halving the loads per multiply-add)
    when the channel blocks pair up, else one vector × ``_pixel_row``. Measured per shape on an
    AVX2 and an AVX-512 build: two vectors win on most of resnet50's and squeezenet's convs
    (up to 1.4x), lose where no divisor fits (a ragged two-vector row is up to 2.6x slower)."""
    top = 6 if isa.registers <= 16 else 7
    rows = [d for d in divisors(width) if 4 <= d <= top]
    if blocks % 2 == 0 and rows:
        return 2, max(rows)
    return 1, _pixel_row(width, isa)


def schedule_conv(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int,
                   weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """Register-tile a convolution over a vector of output channels (weights read with the
    channels innermost) × a row of output pixels (each a broadcast input value): the layout
    oneDNN and MLAS compute in, without changing the tensors' NCHW layout. False (schedule
    untouched) when it does not apply.

    When the weights are the function's parameter at a position in ``weights`` (a weight of
    the model at every call), that parameter takes the packed layout and ``(position, lanes)``
    is returned: ``prepack_weights`` repacks the weight once at build. Otherwise the kernel
    repacks them before the convolution on every call (True)."""
    parts = _conv_parts(sch, block_rv)
    lanes = isa.lanes()
    if parts is None:
        return False
    info, weight, per_group = parts
    (_, _, n, _), (_, _, f, fe), (_, _, y, _), (_, _, x, xe) = info[:4]
    group = per_group or fe  # a tile never straddles two groups: their inputs differ
    if group % lanes or xe < 4:
        return False
    vecs, row = _conv_tile(group // lanes, xe, isa)
    if per_group:
        g, fo, fv, fi = sch.split(f, [fe // group, None, vecs, lanes])
        outer = [n, g, fo, y]
    else:
        fo, fv, fi = sch.split(f, [None, vecs, lanes])
        outer = [n, fo, y]
    xo, xi = sch.split(x, [None, row])
    sch.reorder(*outer, xo, *[lp for _, _, lp, _ in info[4:]], xi, fv, fi)
    fused = sch.fuse(*outer)
    sch.parallel(fused)
    if _staging_pays(sch.get(block_rv).reads[1 - weight].source, info):
        _stage_input_rows(sch, block_rv, 1 - weight, fused)
    done = _pack_output_channels(sch, block_rv, weight, lanes, cores, weights)
    wb = sch.cache_write(block_rv, 0, "local")
    sch.transform_layout(block_rv, ("write", 0), lambda a, o, h, w: (a, h, w, o))
    inline_epilogue(sch, wb)
    sch.reverse_compute_at(wb, xo, preserve_unit_loops=True)
    loops = sch.get_loops(block_rv)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.unroll(loops[-3])
    sch.decompose_reduction(block_rv, loops[-6])
    return done


def schedule_depthwise(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int,
                       weights: frozenset[int] = frozenset()) -> bool:
    """A depthwise convolution (one input channel per output channel) in NCHW: each channel's
    padded plane staged on its own thread (no padded copy of the whole input), then each output
    row in vectors of consecutive pixels (the last, part-filled vector peeled off at lowering),
    each window tap a multiply-add by a broadcast weight, the sums in registers and the
    epilogue on their write-back. Channels (with batch) in parallel. False where it does not
    apply. (TVM's generic tile gave rows of 14 pixels, 32256 tasks over a 144-channel 56x56
    plane, and a padded copy of the whole input first.) The weight is read as it is, a few
    values a channel: ``weights`` is taken for the common signature and not used."""
    parts = _conv_parts(sch, block_rv)
    if parts is None or parts[2] != 1 or parts[0][4][3] != 1:  # one input channel a group
        return False
    info, weight, _ = parts
    (_, _, n, _), (_, _, f, _), (_, _, y, ye), (_, _, x, xe) = info[:4]
    lanes = isa.lanes()
    taps = [lp for _, _, lp, _ in info[4:]]
    if xe >= lanes:
        xo, xi = sch.split(x, [None, lanes])
        if xe % lanes:
            sch.annotate(xo, PEEL_HINT, 1)
        row = [y, xo]
    else:
        xi, row = x, [y]
    sch.reorder(n, f, *row, *taps, xi)
    channel = sch.fuse(n, f)
    if cores > 1:
        sch.parallel(channel)
    _stage_input_rows(sch, block_rv, 1 - weight, channel)
    wb = sch.cache_write(block_rv, 0, "local")
    inline_epilogue(sch, wb)
    if ye * xe * 4 <= MAX_PLANE_EPILOGUE and xe % lanes:
        # a plane whose rows fill no whole vectors (7x7, 14x14): its epilogue runs once the
        # plane is summed, over the plane's pixels in whole vectors, the rest peeled off
        sch.reverse_compute_at(wb, channel, preserve_unit_loops=True)
        pixels = sch.fuse(*sch.get_loops(wb)[-2:])
        outer, inner = sch.split(pixels, [None, lanes])
        sch.annotate(outer, PEEL_HINT, 1)
        sch.vectorize(inner)
    else:
        sch.reverse_compute_at(wb, row[-1], preserve_unit_loops=True)
        wb_inner = sch.get_loops(wb)[-1]
        if int(sch.get(wb_inner).extent) > 1:
            sch.vectorize(wb_inner)
    loops = sch.get_loops(block_rv)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.unroll(loops[-3])
    sch.decompose_reduction(block_rv, taps[0])
    return True


def _pointwise_tile(ext: list[int], per_group: int | None, bits: int, isa: VectorISA
                    ) -> tuple[int, int, int, bool, bool] | None:
    """``(vf, rows, ragged, peel, channels_outer)`` of ``schedule_pointwise``'s tile for a 1x1
    convolution of loop extents ``ext`` (n, f, y, x, rc, ry, rx) over ``bits``-bit values:
    ``vf`` consecutive pixels x ``rows`` output channels, the pixels left over by the last
    whole tile of a plane (``ragged``: the plane is padded), whether that last tile is peeled
    off instead (a grouped convolution), and whether groups of output channels run in parallel
    (``_pixel_tiles``); None where another tile is better."""
    lanes = isa.lanes()
    pixels = ext[2] * ext[3]
    vf = 2 * lanes if pixels % (2 * lanes) == 0 else lanes
    ragged = pixels % vf
    rows = max(d for d in divisors(per_group or ext[1]) if d <= isa.registers // 4)
    peel = False
    if per_group:  # only where a group's channels are no whole vectors (the channel-vector
        if per_group % lanes == 0 or ext[4] < MIN_GROUP_INPUTS:  # tile measured faster
            return None  # where they are: 47 vs 69 us on AVX2)
        peel, ragged = bool(ragged), 0  # the last tile under the split's predicate
    elif ragged:  # tiles of 64 bytes of pixels: an AVX-512 vector, two AVX2 ones (AVX2's 4
        vf = max(vf, 512 // bits)  # rows x 1 vector measured no faster than the channel tile)
    if not ragged and not per_group and pixels * bits // 8 < MIN_STAGED_PLANE:
        return None
    if ragged and (pixels < MIN_RAGGED_VECTORS * vf
                   or ext[4] > MAX_RAGGED_CHANNELS and ext[1] % lanes == 0):
        return None  # the channel-vector tile is better (_ragged_pointwise)
    if rows < 2:
        return None
    channels_outer = (not per_group and ext[1] * ext[4] * bits // 8 >= MIN_CHANNELS_OUTER_BYTES
                      and ext[1] >= 2 * pixels)  # weight / plane bytes = outputs / pixels
    return vf, rows, ragged, peel, channels_outer


def schedule_pointwise(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int,
                        weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """A 1x1, stride-1, unpadded, ungrouped convolution over planes of ``MIN_STAGED_PLANE``
    bytes or more whose pixels fill whole vectors, computed as the matrix product it is in
    NCHW: ``out[o, p] = sum_c w[o, c] * x[c, p]`` over the flattened plane ``p = y * W + x``.
    The register tile is a few output channels (a broadcast weight each) × one or two vectors
    of CONSECUTIVE pixels, so the input is read and the output written as whole vectors
    (the channel-vector tile of ``schedule_conv`` writes each output channel's few pixels
    one by one, a scalar epilogue beside a reduction of only C steps). Each parallel
    iteration stages its vector of pixels of every input channel contiguously first.
    Measured per kernel (AVX-512, 2 threads, inputs rotated through 8 copies so that they
    come from L3, as in a model): resnet50's 56x56 ones 1.3-1.7x faster, its 28x28 ones
    1.15-1.3x; AVX2 build (4 rows x 2 vectors of 8) 1.15-1.4x. A grouped convolution whose
    groups are no whole vectors of channels (ShuffleNet's 34, 68 and 136 per group), which the
    channel-vector tile cannot take, is this product per group, on any plane: its last tile of
    a plane that fills no whole vectors runs under the split's predicate and lowering peels it
    off (2.2-5x faster per kernel, AVX-512 and AVX2). False when it does not apply; else as
    ``schedule_conv`` (a packed weight's lanes are the tile's output channels)."""
    parts = _conv_parts(sch, block_rv)
    if parts is None:
        return False
    info, weight, per_group = parts
    var = [v for _, v, _, _ in info]
    ext = [e for _, _, _, e in info]
    block = sch.get(block_rv)
    data = block.reads[1 - weight]
    at = [(var[0], None), (var[4], None), (var[2], var[5]), (var[3], var[6])]
    if ext[5] != 1 or ext[6] != 1 or not all(
            r.min.same_as(v) or k is not None and isinstance(r.min, tirx.Add)
            and r.min.a.same_as(v) and r.min.b.same_as(k)
            or per_group and v.same_as(var[4])  # a group's channel, checked by _conv_parts
            for r, (v, k) in zip(data.region, at, strict=True)):
        return False  # not a 1x1 window read at x[n, c, y (+ ry), x (+ rx)]: strided, padded
    tile = _pointwise_tile(ext, per_group, tvm.DataType(data.source.dtype).bits, isa)
    if tile is None:
        return False
    vf, rows, ragged, peel, channels_outer = tile
    width = ext[3]
    if param_position(sch, block.writes[0].source) is not None:
        sch.cache_write(block_rv, 0, "global")  # the result's layout is the caller's: flatten
        # an intermediate, written back by a copy as if it were an epilogue

    def flat(n, c, y, x):
        return n, c, y * width + x

    def flat_iters(b):  # iterate block b's (n, c, y, x, ...) as (n, c, y * W + x, ...)
        sch.transform_block_layout(b, tirx.IndexMap.from_func(
            lambda *v: (v[0], v[1], v[2] * width + v[3], *v[4:]),
            ndim=len(sch.get(b).iter_vars)))

    consumers = sch.get_consumers(block_rv)
    if any([int(iv.dom.extent) for iv in sch.get(c).iter_vars] != ext[:4] for c in consumers):
        return False  # only element-wise epilogues over the output's (n, c, y, x) flatten
    sch.transform_layout(block_rv, ("write", 0), flat)
    for consumer in consumers:
        flat_iters(consumer)
    flat_iters(block_rv)
    if ragged:
        return _ragged_pointwise(sch, block_rv, weight, vf, rows, cores, weights,
                                 channels_outer)

    def stage():  # each tile's pixels of every input channel, contiguous
        copy = sch.cache_read(block_rv, 1 - weight, "global")
        sch.transform_layout(copy, ("write", 0), flat)
        flat_iters(copy)
        return copy

    def write_back():  # the tile's accumulators, through the epilogue
        wb = sch.cache_write(block_rv, 0, "local")
        inline_epilogue(sch, wb)
        return wb

    return _pixel_tiles(sch, block_rv, weight, vf, rows, cores, weights, stage, write_back,
                        peel, channels_outer)


def _pixel_tiles(sch: s_tir.Schedule, block_rv, weight: int, vf: int, rows: int, cores: int,
                 weights: frozenset[int], stage, write_back, peel: bool = False,
                 channels_outer: bool = False) -> tuple[int, int, str] | bool:
    """The pointwise register tile over a flattened convolution ``(n, f, p, rc, ry, rx)``:
    ``rows`` output channels x ``vf`` consecutive pixels; ``stage()`` gives the block that
    copies the input, ``write_back()`` the block that writes the accumulators out, placed after
    each tile. Tiles of pixels run in parallel, each staging its pixels of every input channel
    and computing every output channel; with ``channels_outer``, groups of ``rows`` output
    channels run in parallel instead, each over every tile of pixels, the whole plane staged
    first as tiles (``(n, tile, c, pixel)``): each weight is read once, not once per tile.
    ``PEEL_HINT`` on the loop of tiles when ``peel``. Returns what ``_pack_output_channels``
    returns."""
    n, f, p, rc, ry, rx = sch.get_loops(block_rv)
    pc, pv = sch.split(p, [None, vf])
    fo, fi = sch.split(f, [None, rows])
    copy = stage()
    if channels_outer:
        sch.reorder(n, fo, pc, rc, ry, rx, fi, pv)
        outer = sch.fuse(n, fo)
        tiles = pc
        sch.transform_layout(copy, ("write", 0), lambda b, c, q: (b, q // vf, c, q % vf))
        copy_loops = sch.get_loops(copy)
        sch.parallel(copy_loops[1])  # its input channels
    else:
        sch.reorder(n, pc, fo, rc, ry, rx, fi, pv)
        tiles = outer = sch.fuse(n, pc)
        sch.compute_at(copy, outer, preserve_unit_loops=True)
    sch.parallel(outer)
    if peel:
        sch.annotate(tiles, PEEL_HINT, 1)
    sch.annotate(copy, STAGED, 1)
    sch.vectorize(sch.get_loops(copy)[-1])
    done = _pack_output_channels(sch, block_rv, weight, rows, cores, weights)
    wb = write_back()
    sch.reverse_compute_at(wb, pc if channels_outer else fo, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(wb)[-1])
    loops = sch.get_loops(block_rv)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.decompose_reduction(block_rv, loops[2])
    return done


def _ragged_pointwise(sch: s_tir.Schedule, block_rv, weight: int, vf: int, rows: int,
                      cores: int, weights: frozenset[int], channels_outer: bool = False
                      ) -> tuple[int, int, str] | bool:
    """``schedule_pointwise`` over a flattened plane whose pixels fill no whole vectors
    (squeezenet's 55x55, 27x27, 13x13; resnet50's 14x14 and 7x7 with 16 lanes): the
    convolution computes a plane padded to whole vectors (``pad_einsum``: the staged input is
    zero past the plane, the padded outputs are never written), so its register tile is the
    same; the parallel loop of pixel tiles carries a partition hint, and lowering peels its
    last tile off (``peel_ragged_tiles``): every other tile stages, computes and writes whole
    vectors with no condition left, the last one stages and writes its pixels one by one."""
    sch.reindex(block_rv, ("read", 1 - weight))
    sch.pad_einsum(block_rv, [1, 1, vf, 1, 1, 1])
    padded = sch.get(block_rv).reads[1 - weight].source  # the input, zero past the plane
    (stage,) = [b for b in sch.get_producers(block_rv)
                if sch.get(b).writes[0].source.same_as(padded)]
    sch.compute_inline(sch.get_producers(stage)[0])  # its reindexed copy: read x directly
    swap = lambda n, p, c: (n, c, p)  # noqa: E731  the reindexed input is (n, p, c)
    sch.transform_layout(stage, ("write", 0), swap)
    sch.transform_block_layout(stage, tirx.IndexMap.from_func(swap))
    (unpad,) = sch.get_consumers(block_rv)  # writes the plane's pixels of the padded result
    inline_epilogue(sch, unpad)

    def write_back():  # the padded result lives in the tile's registers only
        sch.set_scope(block_rv, 0, "local")
        return unpad

    return _pixel_tiles(sch, block_rv, weight, vf, rows, cores, weights, lambda: stage,
                        write_back, True, channels_outer)


def _pack_output_channels(sch: s_tir.Schedule, block_rv, weight: int, lanes: int, cores: int,
                          weights: frozenset[int]) -> tuple[int, int, str] | bool:
    """Read a convolution's weight ``w[o, i, kh, kw]`` as ``w[o // lanes, i, kh, kw, o % lanes]``:
    ``(position, lanes, "oc")`` when it is a parameter at a position in ``weights``
    (``prepack_weights`` packs it once at build), else the kernel repacks it on every call
    (True; IC·KH·KW·OC moves a call against H·W times as many multiply-adds)."""
    position = param_position(sch, sch.get(block_rv).reads[weight].source)
    pack = lambda o, i, kh, kw: (o // lanes, i, kh, kw, o % lanes)  # noqa: E731
    if position in weights:
        sch.transform_layout(block_rv, ("read", weight), pack)
        return position, lanes, "oc"
    packed = sch.cache_read(block_rv, weight, "global")
    sch.transform_layout(packed, ("write", 0), pack)
    if cores > 1:
        sch.parallel(sch.get_loops(packed)[0])
    return True


def _staging_pays(data: tirx.Buffer, info: list) -> bool:
    """Whether a convolution reads its input through a staged copy of the rows each parallel
    iteration needs (``_stage_input_rows``): planes of ``MIN_STAGED_PLANE`` bytes or more, at
    least 64 input rows per register tile (input channels × kernel height) and windows up to
    3x3. Measured per kernel in resnet50, squeezenet and alexnet (AVX-512, 2 threads): the
    56x56 and 28x28 convolutions 0.63-0.97x; 27x27, 14x14 and 7x7 planes, tiles of fewer
    rows (squeezenet's 16-channel 55x55 ones) and alexnet's 5x5 window 1.06-1.8x."""
    (_, _, _, channels), (_, _, _, kh), (_, _, _, kw) = info[4:7]
    plane = int(data.shape[-1]) * int(data.shape[-2]) * tvm.DataType(data.dtype).bits // 8
    return plane >= MIN_STAGED_PLANE and channels * kh >= 64 and kh <= 3 and kw <= 3


def _stage_input_rows(sch: s_tir.Schedule, block_rv, data: int, loop) -> None:
    """Copy the input rows that one iteration of ``loop`` (output channels × one output row)
    reads into a buffer of its own first, padding included (the pad block moves there, so no
    padded copy of the whole input is written and read back).

    In NCHW a register tile's reduction reads a few pixels of each of C × KH rows, a whole
    plane apart: on planes of a page or more every row sits on a page of its own, which the
    hardware prefetchers do not follow. The staged rows are contiguous, per iteration and per
    thread (allocated inside the parallel loop); the sums are the same, bit for bit."""
    source = sch.get(block_rv).reads[data].source
    pads = [p for p in sch.get_producers(block_rv)
            if sch.get(p).writes[0].source.same_as(source)]
    if pads and len(sch.get_consumers(pads[0])) != 1:
        return
    stage = pads[0] if pads else sch.cache_read(block_rv, data, "global")
    sch.compute_at(stage, loop, preserve_unit_loops=True)
    sch.annotate(stage, STAGED, 1)
    inner = sch.get_loops(stage)[-1]
    if int(sch.get(inner).extent) >= 4:
        sch.vectorize(inner)


def peel_ragged_tiles(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` ready to have the loops annotated ``PEEL_HINT`` peeled at lowering: TVM's
    LoopPartition finds the hint by loop variable, and lowering narrows 64-bit loop variables
    to 32 bits before it without renaming the hint's (the hint is lost), so the indices go to
    32 bits here first. Every extent of a kernel hgrt builds fits in 32 bits."""
    return tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))["main"]
