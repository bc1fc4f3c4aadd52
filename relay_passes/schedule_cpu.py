"""schedule_cpu: a cheap default schedule for every CPU PrimFunc that MetaSchedule did not tune.

Unscheduled TIR (LegalizeOps → FuseTIR output) runs on one core, scalar. This pass gives each
CPU PrimFunc a fixed, deterministic schedule in milliseconds, without measuring anything:

- producers that are plain copies / elementwise (a 1×1 conv's pad, an ``add`` before a
  ``relu``) are inlined into their consumer; producers with an ``if_then_else`` (a real pad)
  stay separate so that no branch lands in an inner loop;
- the anchor reduction (conv2d, matmul, pooling) gets a register tile: the output's innermost
  axis split into a vector of about one or two SIMD registers, another output axis whose value
  the vectorized reads do not depend on (a conv's output channel, a matmul's row) split into
  up to 8 rows, reductions between the outer and the tile loops, the accumulator cached in a
  tile-sized buffer, the elementwise epilogue (bias, relu) inlined into its write-back, the
  outer spatial loops fused and parallel;
- a convolution over large planes reads the input rows each parallel iteration needs from a
  staged contiguous copy (padding included) instead of a whole plane apart per channel;
- a 1x1 stride-1 convolution over a large plane whose pixels fill whole vectors is tiled as
  the matrix product it is in NCHW (output channels x vectors of consecutive pixels,
  ``_schedule_pointwise``);
- every other block: outer loops fused and parallel, innermost vectorized.

Functions it cannot schedule are left as they are and counted (``ScheduleReport.skipped``).
Results never change: only schedule primitives are used, and each is checked by TVM.

>>> mod, report = schedule_cpu_functions(fused_mod, host_target())  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx
from tvm.sym.pattern import detect_linear_equation

from hgrt.devices import VectorISA, vector_isa
from hgrt.relay_passes.context import BuildContext
from hgrt.relay_passes.pipeline import contract
from hgrt.relay_passes.prepack_weights import prepack, weight_params
from hgrt.relay_passes.relax_util import SCHEDULED_ATTR, func_target, is_scheduled, prim_funcs

__all__ = ["ScheduleReport", "default_schedule_trace", "schedule_cpu", "schedule_cpu_functions"]

# a kernel with fewer output elements than this runs serial: a parallel launch costs µs
MIN_PARALLEL_WORK = 4096
MAX_TILE_ROWS = 8  # rows of the register tile (× one or more vectors of lanes)
# a convolution reads input planes of this many bytes or more through staged rows: 28x28
# float32 planes and up (_staging_pays)
MIN_STAGED_PLANE = 3072
_STAGED = "hgrt_staged_rows"  # block annotation of a staged copy
# a 1x1 convolution over a plane that fills no whole vectors takes the pointwise tile
# (_ragged_pointwise) over this many vectors of pixels or more, when it reads this many input
# channels or fewer, or has output channels the channel-vector tile cannot take
MIN_RAGGED_VECTORS = 8
MAX_RAGGED_CHANNELS = 128
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

_get_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
# a primitive that does not apply raises ScheduleError (a RuntimeError); TVM's own checks too
_SCHEDULE_ERRORS = (RuntimeError, ValueError)
# intrinsics that TVM 0.27's LLVM backend cannot emit on vectors ("unknown intrinsic
# tirx.cosh" at build): a function calling one is left unscheduled, as the Relax VM runs it (of
# 32 float intrinsics built vectorized for haswell and znver4, only these two failed)
_SCALAR_ONLY = re.compile(r"\bT\.(sinh|cosh)\(")


@dataclass
class ScheduleReport:
    """What ``schedule_cpu_functions`` did, per PrimFunc name."""

    tiled: list[str] = field(default_factory=list)  # anchor reduction got a register tile
    scheduled: list[str] = field(default_factory=list)  # all scheduled functions
    skipped: dict[str, str] = field(default_factory=dict)  # name → why it was left as it is
    not_cpu: list[str] = field(default_factory=list)  # another target's, untouched
    # name → (parameter position, lanes, layout): a weight it reads packed (``prepack_weights``)
    prepacked: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"default CPU schedule: {len(self.scheduled)} scheduled ({len(self.tiled)} "
                f"register-tiled, {len(self.prepacked)} with prepacked weights), "
                f"{len(self.skipped)} skipped, {len(self.not_cpu)} not CPU")


# ---------------------------------------------------------------------------------------------
# block analysis


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _vector_factor(n: int, lanes: int) -> int | None:
    """Vector width for a loop of extent ``n``: a divisor of ``n``, at most one register or a
    whole number of registers (LLVM widens a 13-lane vector to one masked register but splits
    a 27-lane one into pieces), at least 4 lanes.

    A divisor, because a split that does not divide puts a ``T.where`` in the vector loop and
    TVM then scalarizes it; ``None`` when nothing fits.
    """
    if n <= lanes:
        return n if n >= 4 else None
    divs = _divisors(n)
    full = [d for d in divs if d % lanes == 0 and d <= 4 * lanes]
    if full:
        return max(full)
    part = [d for d in divs if 4 <= d <= lanes]
    return max(part) if part else None


def _uses(expr: tirx.Expr, var: tirx.Var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def _stride(expr: tirx.Expr, var: tirx.Var) -> int | None:
    coef = detect_linear_equation(expr, [var])
    return int(coef[0]) if len(coef) == 2 and isinstance(coef[0], tirx.IntImm) else None


def _contains_if(block: s_tir.SBlock) -> bool:
    return "if_then_else" in block.body.script()


def _iter_loops(sch: s_tir.Schedule, block_rv) -> list[tuple[str, tirx.Var, object, int]] | None:
    """``(kind, block var, loop rv, extent)`` per loop when loops map 1:1 onto block vars."""
    block = sch.get(block_rv)
    loops = sch.get_loops(block_rv)
    values = list(_get_realize(sch, block_rv).iter_values)
    if len(loops) != len(block.iter_vars) or len(values) != len(loops):
        return None
    out = []
    for iv, value, lp in zip(block.iter_vars, values, loops, strict=True):
        loop = sch.get(lp)
        if not value.same_as(loop.loop_var) or not isinstance(loop.extent, tirx.IntImm):
            return None
        kind = {0: "S", 2: "R"}.get(int(iv.iter_type))
        if kind is None:
            return None
        out.append((kind, iv.var, lp, int(loop.extent)))
    return out


def _scalar_only_call(func: tirx.PrimFunc) -> str | None:
    """The first intrinsic of ``_SCALAR_ONLY`` that ``func`` calls, if any."""
    found = _SCALAR_ONLY.search(func.script())
    return f"tirx.{found.group(1)}" if found else None


def _is_reduction(sch: s_tir.Schedule, block_rv) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block_rv).iter_vars)


# ---------------------------------------------------------------------------------------------
# schedules


def _inline_producers(sch: s_tir.Schedule) -> None:
    """Inline elementwise intermediates (not outputs, no branches) into their consumers."""
    root = sch.get_sblock("root")
    changed = True
    while changed:
        changed = False
        outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
        for b in sch.get_child_blocks(root):
            block = sch.get(b)
            if (block.name_hint in outputs or _is_reduction(sch, b) or _contains_if(block)
                    or not sch.get_consumers(b)):
                continue
            try:
                sch.compute_inline(b)
                changed = True
                break
            except _SCHEDULE_ERRORS:
                continue


def _parallel_outer(sch: s_tir.Schedule, loops: list, extents: list[int], total: int) -> None:
    """Fuse ``loops`` (the outer spatial ones) and make them parallel if there is work enough."""
    if not loops or total < MIN_PARALLEL_WORK or max(extents) <= 1 and len(loops) == 1:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if int(sch.get(fused).extent) > 1:
        sch.parallel(fused)


def _vectorize_last(sch: s_tir.Schedule, loop, extent: int, lanes: int):
    """Vectorize ``loop`` (split off a vector-sized inner part); returns the outer rest."""
    vf = _vector_factor(extent, lanes)
    if vf == extent:
        sch.vectorize(loop)
        return None
    outer, inner = sch.split(loop, [None, vf or lanes])
    sch.vectorize(inner)
    return outer


def _schedule_spatial(sch: s_tir.Schedule, block_rv, lanes: int) -> None:
    info = _iter_loops(sch, block_rv)
    if info is None:
        raise _CannotSchedule("loops do not map onto block vars")
    if not info:
        return  # an opaque block (scatter_nd's): its loops are its own, left as they are
    extents = [e for _, _, _, e in info]
    total = math.prod(extents)
    loops = [lp for _, _, lp, _ in info]
    rest = _vectorize_last(sch, loops[-1], extents[-1], lanes) if extents[-1] > 1 else loops[-1]
    outer = loops[:-1] + ([rest] if rest is not None and extents[-1] > 1 else [])
    outer_ext = [int(sch.get(lp).extent) for lp in outer]
    _parallel_outer(sch, outer, outer_ext, total)


def _schedule_reduction_plain(sch: s_tir.Schedule, block_rv) -> None:
    """A reduction the register tile does not fit (e.g. a channel mean): parallel outer axes."""
    info = _iter_loops(sch, block_rv)
    if info is None:
        raise _CannotSchedule("loops do not map onto block vars")
    lead = [(lp, e) for _, _, lp, e in itertools.takewhile(lambda t: t[0] == "S", info)]
    total = math.prod(e for _, e in lead) * math.prod(e for k, _, _, e in info if k == "R")
    if len(lead) > 1:  # the innermost stays serial: no div/mod of a fused index per element
        lead = lead[:-1]
    _parallel_outer(sch, [lp for lp, _ in lead], [e for _, e in lead], total)


def _vector_reads(block: s_tir.SBlock, vvar: tirx.Var) -> list[list[tirx.Expr]] | None:
    """The indices of the reads that depend on the vector axis ``vvar``; None unless it is the
    last non-unit index of the output and only ever the last index of those reads."""
    w_idx = [r.min for r in block.writes[0].region if not (
        isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 and not _uses(r.min, vvar))]
    if not w_idx or not w_idx[-1].same_as(vvar):
        return None
    vec_reads = []
    for r in block.reads:
        idx = [x.min for x in r.region]
        hits = [i for i, e in enumerate(idx) if _uses(e, vvar)]
        if hits and hits != [len(idx) - 1]:
            return None
        if hits:
            vec_reads.append(idx)
    return vec_reads


def _register_rows(spatial: list, vi: int, vf: int, isa: VectorISA, vec_reads: list
                   ) -> tuple[int | None, int]:
    """(position, rows) of the output axis that the vectorized reads do not depend on (so its
    loads are reused), split into up to MAX_TILE_ROWS register rows; (None, 1) when none.

    The accumulators (rows × vector registers per row) take three quarters of the ISA's
    vector registers (24 of AVX-512's 32, 12 of AVX2's 16); the rest hold the loads and the
    broadcast weight, so nothing spills in the inner loop."""
    ri, rf = None, 1
    nvec = -(-vf // isa.lanes())  # vector registers per row
    limit = max(1, min(MAX_TILE_ROWS, (isa.registers * 3 // 4) // nvec))
    for i, (var, _, ext) in enumerate(spatial):
        if i == vi or ext <= 1 or any(_uses(e, var) for idx in vec_reads for e in idx):
            continue
        f = max(d for d in _divisors(ext) if d <= limit)
        if f > rf:
            ri, rf = i, f
    return ri, rf


def _tile_loops(sch: s_tir.Schedule, spatial: list, reduce_: list, vi: int, vf: int,
                ri: int | None, rf: int):
    """Split off the vector and row tile, order outer loops / reductions / tile; returns the
    outer loops fused into one."""
    outer, inner = [], []
    for i, (_, lp, ext) in enumerate(spatial):
        if i == vi:
            if vf < ext:
                o, lp = sch.split(lp, [None, vf])
                outer.append(o)
            vec_loop = lp
        elif i == ri and rf > 1:
            o, n = sch.split(lp, [None, rf])
            outer.append(o)
            inner.append(n)
        else:
            outer.append(lp)
    sch.reorder(*outer, *[lp for _, lp, _ in reduce_], *inner, vec_loop)
    return sch.fuse(*outer) if len(outer) > 1 else outer[0]


def _accumulate_in_tile(sch: s_tir.Schedule, block_rv, fused, rf: int) -> None:
    """Accumulate in a tile-sized buffer; the epilogue (bias, relu) rides on its write-back."""
    wb = sch.cache_write(block_rv, 0, "global")
    _inline_epilogue(sch, wb)
    sch.reverse_compute_at(wb, fused, preserve_unit_loops=True)
    wb_loops = sch.get_loops(wb)
    if int(sch.get(wb_loops[-1]).extent) > 1:
        sch.vectorize(wb_loops[-1])
    r_loops = sch.get_loops(block_rv)
    sch.vectorize(r_loops[-1])
    if rf > 1:
        sch.unroll(r_loops[-2])
    # the init block inherits the vectorized / unrolled tile loops
    sch.decompose_reduction(block_rv, sch.get_loops(block_rv)[1])


def _schedule_anchor(sch: s_tir.Schedule, block_rv, isa: VectorISA,
                     weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """Register-tile a reduction whose output's innermost axis can be vectorized. A matrix
    product's ``w[k, n]`` that is a weight of the model (a parameter at a position in
    ``weights``) is read packed as ``w[n // vf, k, n % vf]``, one vector tile's columns
    contiguous (``prepack_weights`` packs it at build; ``(position, vf, "col")`` is
    returned): unpacked, each ``k`` of a tile's reduction reads a row of the matrix away,
    a page or more for 1000+ columns (resnet50's classifier 1.0 -> 0.56 ms, AVX-512)."""
    info = _iter_loops(sch, block_rv)
    if info is None or not re.fullmatch(r"S+R+", "".join(k for k, _, _, _ in info)):
        return False
    block = sch.get(block_rv)
    spatial = [(v, lp, e) for k, v, lp, e in info if k == "S"]
    reduce_ = [(v, lp, e) for k, v, lp, e in info if k == "R"]
    nonunit = [i for i, (_, _, e) in enumerate(spatial) if e > 1]
    if len(block.writes) != 1 or not nonunit:
        return False
    vi = nonunit[-1]
    vvar, _, vext = spatial[vi]
    vec_reads = _vector_reads(block, vvar)
    vf = _vector_factor(vext, isa.lanes())
    if vec_reads is None or vf is None:
        return False
    ri, rf = _register_rows(spatial, vi, vf, isa, vec_reads)
    if rf == 1 and not all(_stride(idx[-1], vvar) == 1 for idx in vec_reads):
        return False  # a strided gather with no reuse (a pooling window): LLVM does better
    packed = _pack_columns(sch, block_rv, vvar, [v for v, _, _ in reduce_], vf, weights)
    fused = _tile_loops(sch, spatial, reduce_, vi, vf, ri, rf)
    if math.prod(e for _, _, e in spatial) >= MIN_PARALLEL_WORK and int(sch.get(fused).extent) > 1:
        sch.parallel(fused)
    _accumulate_in_tile(sch, block_rv, fused, rf)
    return packed or True


def _param_position(sch: s_tir.Schedule, buffer) -> int | None:
    """The position of ``buffer`` among the function's parameters, None if not one."""
    return next((i for i, p in enumerate(sch.mod["main"].params) if p.same_as(buffer)), None)


def _pack_columns(sch: s_tir.Schedule, block_rv, n: tirx.Var, reduce_vars: list, vf: int,
                  weights: frozenset[int]) -> tuple[int, int, str] | None:
    """Read a weight ``w[k, n]`` (k the only reduction) as ``w[n // vf, k, n % vf]``."""
    if len(reduce_vars) != 1:
        return None
    block = sch.get(block_rv)
    for i, r in enumerate(block.reads):
        idx = [x.min for x in r.region]
        if len(idx) != 2 or not idx[0].same_as(reduce_vars[0]) or not idx[1].same_as(n):
            continue
        position = _param_position(sch, r.source)
        if position in weights and int(r.source.shape[1]) % vf == 0:
            sch.transform_layout(block_rv, ("read", i), lambda k, c: (c // vf, k, c % vf))
            return position, vf, "col"
    return None


# ---------------------------------------------------------------------------------------------
# convolutions: a vector of output channels × a row of output pixels


def _group_index(expr: tirx.Expr, f: tirx.Var, rc: tirx.Var) -> int | None:
    """``per_group`` when ``expr`` is a grouped convolution's input channel
    ``f // per_group * in_per_group + rc``, else None."""
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
    info = _iter_loops(sch, block_rv)
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
            if per_group is None or any(_uses(e, var[1]) for j, e in enumerate(idx) if j != 1):
                return None
        elif any(_uses(e, var[1]) for e in idx):
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
    fits = [d for d in _divisors(width) if 6 <= d <= cap]
    return max(fits) if fits else 8


def _conv_tile(blocks: int, width: int, isa: VectorISA) -> tuple[int, int]:
    """``(vectors, pixels)`` of a convolution's register tile: two vectors of output channels
    × a row of pixels that divides the output width (4 to 6 pixels with 16 registers, 4 to 7
    with 32: each pixel's broadcast feeds two multiply-adds, halving the loads per multiply-add)
    when the channel blocks pair up, else one vector × ``_pixel_row``. Measured per shape on an
    AVX2 and an AVX-512 build: two vectors win on most of resnet50's and squeezenet's convs
    (up to 1.4x), lose where no divisor fits (a ragged two-vector row is up to 2.6x slower)."""
    top = 6 if isa.registers <= 16 else 7
    rows = [d for d in _divisors(width) if 4 <= d <= top]
    if blocks % 2 == 0 and rows:
        return 2, max(rows)
    return 1, _pixel_row(width, isa)


def _schedule_conv(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int,
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
    _inline_epilogue(sch, wb)
    sch.reverse_compute_at(wb, xo, preserve_unit_loops=True)
    loops = sch.get_loops(block_rv)
    sch.vectorize(loops[-1])
    sch.unroll(loops[-2])
    sch.unroll(loops[-3])
    sch.decompose_reduction(block_rv, loops[-6])
    return done


def _schedule_pointwise(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int,
                        weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """A 1x1, stride-1, unpadded, ungrouped convolution over planes of ``MIN_STAGED_PLANE``
    bytes or more whose pixels fill whole vectors, computed as the matrix product it is in
    NCHW: ``out[o, p] = sum_c w[o, c] * x[c, p]`` over the flattened plane ``p = y * W + x``.
    The register tile is a few output channels (a broadcast weight each) × one or two vectors
    of CONSECUTIVE pixels, so the input is read and the output written as whole vectors
    (the channel-vector tile of ``_schedule_conv`` writes each output channel's few pixels
    one by one, a scalar epilogue beside a reduction of only C steps). Each parallel
    iteration stages its vector of pixels of every input channel contiguously first.
    Measured per kernel (AVX-512, 2 threads, inputs rotated through 8 copies so that they
    come from L3, as in a model): resnet50's 56x56 ones 1.3-1.7x faster, its 28x28 ones
    1.15-1.3x; AVX2 build (4 rows x 2 vectors of 8) 1.15-1.4x. A grouped convolution whose
    groups are no whole vectors of channels (ShuffleNet's 34, 68 and 136 per group), which the
    channel-vector tile cannot take, is this product per group, on any plane: its last tile of
    a plane that fills no whole vectors runs under the split's predicate and lowering peels it
    off (2.2-5x faster per kernel, AVX-512 and AVX2). False when it does not apply; else as
    ``_schedule_conv`` (a packed weight's lanes are the tile's output channels)."""
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
    lanes = isa.lanes()
    width, pixels = ext[3], ext[2] * ext[3]
    vf = 2 * lanes if pixels % (2 * lanes) == 0 else lanes
    bits = tvm.DataType(data.source.dtype).bits
    ragged = pixels % vf
    rows = max(d for d in _divisors(per_group or ext[1]) if d <= isa.registers // 4)
    peel = False
    if per_group:  # only where a group's channels are no whole vectors (the channel-vector
        if per_group % lanes == 0 or ext[4] < MIN_GROUP_INPUTS:  # tile measured faster
            return False  # where they are: 47 vs 69 us on AVX2)
        peel, ragged = bool(ragged), 0  # the last tile under the split's predicate
    elif ragged:  # tiles of 64 bytes of pixels: an AVX-512 vector, two AVX2 ones (AVX2's 4
        vf = max(vf, 512 // bits)  # rows x 1 vector measured no faster than the channel tile)
    if not ragged and not per_group and pixels * bits // 8 < MIN_STAGED_PLANE:
        return False
    if ragged and (pixels < MIN_RAGGED_VECTORS * vf
                   or ext[4] > MAX_RAGGED_CHANNELS and ext[1] % lanes == 0):
        return False  # the channel-vector tile is better (_ragged_pointwise)
    if rows < 2:
        return False
    channels_outer = (not per_group and ext[1] * ext[4] * bits // 8 >= MIN_CHANNELS_OUTER_BYTES
                      and ext[1] >= 2 * pixels)  # weight / plane bytes = outputs / pixels
    if _param_position(sch, block.writes[0].source) is not None:
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
        _inline_epilogue(sch, wb)
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
    sch.annotate(copy, _STAGED, 1)
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
    """``_schedule_pointwise`` over a flattened plane whose pixels fill no whole vectors
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
    _inline_epilogue(sch, unpad)

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
    position = _param_position(sch, sch.get(block_rv).reads[weight].source)
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
    sch.annotate(stage, _STAGED, 1)
    inner = sch.get_loops(stage)[-1]
    if int(sch.get(inner).extent) >= 4:
        sch.vectorize(inner)


def _inline_epilogue(sch: s_tir.Schedule, wb) -> None:
    """Fold the elementwise consumers of ``wb`` (bias, relu, a residual add) into it."""
    while True:
        consumers = sch.get_consumers(wb)
        if len(consumers) != 1 or _is_reduction(sch, consumers[0]):
            return
        try:
            sch.reverse_compute_inline(consumers[0])
        except _SCHEDULE_ERRORS:
            return


def _find_block(sch: s_tir.Schedule, name: str):
    try:
        return sch.get_sblock(name)
    except _SCHEDULE_ERRORS:  # inlined into another block
        return None


def peel_ragged_tiles(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` ready to have the loops annotated ``PEEL_HINT`` peeled at lowering: TVM's
    LoopPartition finds the hint by loop variable, and lowering narrows 64-bit loop variables
    to 32 bits before it without renaming the hint's (the hint is lost), so the indices go to
    32 bits here first. Every extent of a kernel hgrt builds fits in 32 bits."""
    return tirx.transform.ForceNarrowIndexToInt32()(tvm.IRModule({"main": func}))["main"]


def _cores(target: tvm.target.Target) -> int:
    return int(target.attrs.get("num-cores", 1) or 1)


class _CannotSchedule(Exception):
    pass


def default_schedule_trace(func: tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Trace | None:
    """The default schedule of one PrimFunc as a schedule trace (what ``hgrt tune`` measures
    and records next to MetaSchedule's candidates), or None when it cannot be scheduled."""
    try:
        sch, _, _ = _default_schedule(func, vector_isa(target), _cores(target))
    except (*_SCHEDULE_ERRORS, _CannotSchedule):
        return None
    return sch.trace


def _schedule_window(sch: s_tir.Schedule, block_rv) -> bool:
    """A padded pooling window (TOPI's ``pool_max`` / ``pool_sum`` reading a padded copy of
    its input): the pad inlined into the window's reads (no padded copy written and read back),
    the window loops outside the output row, output rows in parallel. Measured on resnet50's
    3x3/2 max pool (64x112x112, pad 1): 0.65 ms with the padded copy, 0.30 ms this way (AVX-512,
    2 threads). Unpadded and stride-1 pools keep the plain schedule (measured 2x-6x slower
    with the window loops outside the row)."""
    block = sch.get(block_rv)
    pads = [p for p in sch.get_producers(block_rv) if _contains_if(sch.get(p))]
    if block.name_hint not in ("pool_max", "pool_sum") or len(pads) != 1:
        return False
    info = _iter_loops(sch, block_rv)
    if info is None or not re.fullmatch(r"S+R+", "".join(k for k, _, _, _ in info)):
        return False
    last = [v for k, v, _, _ in info if k == "S"][-1]
    strides = [_stride(r.region[-1].min, last) for r in block.reads]
    if max((st or 0) for st in strides) < 2:
        return False  # stride 1 (inception's 3x3/1 pools): 0.06 -> 0.38 ms this way
    sch.compute_inline(pads[0])
    info = _iter_loops(sch, block_rv)
    spatial = [lp for k, _, lp, _ in info if k == "S"]
    reduce_ = [lp for k, _, lp, _ in info if k == "R"]
    sch.reorder(*spatial[:-1], *reduce_, spatial[-1])
    outer = sch.fuse(*spatial[:-1]) if len(spatial) > 2 else spatial[0]
    sch.parallel(outer)
    sch.decompose_reduction(block_rv, reduce_[0])
    return True


def _on_copy(sch: s_tir.Schedule, name: str, schedule, *args
             ) -> tuple[s_tir.Schedule, object] | None:
    """``(copy of sch, what schedule returned)`` after ``schedule(copy, block name, *args)``;
    None when it returned a falsy value or a primitive failed half-way (``sch`` untouched)."""
    trial = sch.copy()
    try:
        done = schedule(trial, trial.get_sblock(name), *args)
    except (*_SCHEDULE_ERRORS, _CannotSchedule):
        return None
    return (trial, done) if done else None


def _default_schedule(func: tirx.PrimFunc, isa: VectorISA, cores: int = 1,
                      weights: frozenset[int] = frozenset()
                      ) -> tuple[s_tir.Schedule, bool, tuple[int, int, str] | None]:
    """The default schedule of ``func``, whether a register tile was used, and the weight
    parameter that takes a packed layout (``_schedule_conv``), if any."""
    if (op := _scalar_only_call(func)) is not None:
        raise _CannotSchedule(f"calls {op}, which LLVM cannot emit on vectors")
    sch = s_tir.Schedule(func)
    prepacked = None
    _inline_producers(sch)
    tiled = False
    done: set[str] = set()
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    for name in names:  # anchors first: they absorb their epilogues
        b = _find_block(sch, name)
        if b is None or not _is_reduction(sch, b):
            continue
        how: tuple[int, int, str] | bool = False
        conv = (_on_copy(sch, name, _schedule_pointwise, isa, cores, weights)
                or _on_copy(sch, name, _schedule_conv, isa, cores, weights))
        if conv is not None:
            sch, how = conv
        elif (window := _on_copy(sch, name, _schedule_window)) is not None:
            sch = window[0]
        elif not (how := _schedule_anchor(sch, b, isa, weights)):
            _schedule_reduction_plain(sch, sch.get_sblock(name))
        if how:
            tiled = True
            if isinstance(how, tuple) and prepacked is not None:
                return _default_schedule(func, isa, cores, frozenset())  # one packed per func
            if isinstance(how, tuple):
                prepacked = how
        done.add(name)
    for name in names:
        b = _find_block(sch, name)
        if b is None or name in done or _is_reduction(sch, b):
            continue
        if _STAGED in sch.get(b).annotations:
            continue  # scheduled with its convolution
        _schedule_spatial(sch, b, isa.lanes())
    return sch, tiled, prepacked


def schedule_cpu_functions(mod: tvm.IRModule, target: tvm.target.Target | str | None = None,
                           weights: dict[str, set[int]] | None = None
                           ) -> tuple[tvm.IRModule, ScheduleReport]:
    """Give every CPU PrimFunc of ``mod`` a cheap default schedule (parallel + vectorized);
    the report says which functions it scheduled, tiled, skipped, and which take a weight in
    a packed layout: only at positions ``weights[name]`` (a weight at every call; the caller
    must then pass it packed, ``prepack_weights.prepack``).

    A PrimFunc is scheduled when its ``target`` attr is an llvm target, or when it has none and
    ``target`` is one; functions already marked ``tirx.is_scheduled`` and those that cannot be
    scheduled are left as they are. ``mod`` is returned untouched when nothing changed.
    """
    if isinstance(target, (str, dict)):
        target = tvm.target.Target(target)
    report = ScheduleReport()
    new = None
    for name, func in sorted(prim_funcs(mod).items()):
        ftarget = func_target(func, target)
        if ftarget is None or ftarget.kind.name != "llvm":
            report.not_cpu.append(name)
            continue
        if is_scheduled(func):
            continue  # already scheduled (a tuned function from a database, say)
        try:
            sch, tiled, packed = _default_schedule(func, vector_isa(ftarget), _cores(ftarget),
                                                   frozenset((weights or {}).get(name, ())))
        except (*_SCHEDULE_ERRORS, _CannotSchedule) as e:
            report.skipped[name] = str(e).strip().splitlines()[0][:200] if str(e) else "error"
            continue
        if new is None:
            new = mod.clone()
        scheduled = sch.mod["main"]
        if PEEL_HINT in str(sch.trace):
            scheduled = peel_ragged_tiles(scheduled)
        new.update_func(new.get_global_var(name), scheduled.with_attr(SCHEDULED_ATTR, True))
        report.scheduled.append(name)
        if tiled:
            report.tiled.append(name)
        if packed is not None:
            report.prepacked[name] = packed
    return (mod if new is None else new), report


# CPU kernels are known by their target; the tuned ones are scheduled already
@contract(reads={"weights"}, writes={"lowered", "weights"},
          after=("assign_targets", "apply_tuning"))
def schedule_cpu(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """The default schedule for every CPU kernel not scheduled yet (none with
    ``HGRT_DEFAULT_SCHEDULE=0``), its report in ``ctx.lowered.cpu_schedule``; the weights it
    reads in another layout are prepacked (new weights)."""
    if os.environ.get("HGRT_DEFAULT_SCHEDULE", "1") == "0":
        return mod
    mod, report = schedule_cpu_functions(mod, weights=weight_params(mod, ctx))
    ctx.lowered.cpu_schedule = report
    ctx.log(report.summary())
    return prepack(mod, ctx, report.prepacked)
