"""The parts of hgrt's default CPU schedule that any block takes (``cpu_schedule`` puts them
together): reading a block's loops and accesses, inlining producers and epilogues, the generic
schedule of a spatial block or a plain reduction (outer loops fused and parallel, the innermost
vectorized), the register tile of a reduction whose output's innermost axis vectorizes (a
matrix product, a channel-last reduction: ``schedule_anchor``), and padded pooling windows.

Every primitive is TVM's, checked by TVM: a primitive that does not apply raises one of
``SCHEDULE_ERRORS``; a block these schedules cannot take raises ``CannotSchedule``.
"""

from __future__ import annotations

import itertools
import math
import re

import tvm
from tvm import s_tir, tirx
from tvm.sym.pattern import detect_linear_equation

from hgrt.devices import VectorISA

# a kernel with fewer output elements than this runs serial: a parallel launch costs µs
MIN_PARALLEL_WORK = 4096
MAX_TILE_ROWS = 8  # rows of the register tile (× one or more vectors of lanes)
get_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")
# a primitive that does not apply raises ScheduleError (a RuntimeError); TVM's own checks too
SCHEDULE_ERRORS = (RuntimeError, ValueError)


class CannotSchedule(Exception):
    pass


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def vector_factor(n: int, lanes: int) -> int | None:
    """Vector width for a loop of extent ``n``: a divisor of ``n``, at most one register or a
    whole number of registers (LLVM widens a 13-lane vector to one masked register but splits
    a 27-lane one into pieces), at least 4 lanes.

    A divisor, because a split that does not divide puts a ``T.where`` in the vector loop and
    TVM then scalarizes it; ``None`` when nothing fits.
    """
    if n <= lanes:
        return n if n >= 4 else None
    divs = divisors(n)
    full = [d for d in divs if d % lanes == 0 and d <= 4 * lanes]
    if full:
        return max(full)
    part = [d for d in divs if 4 <= d <= lanes]
    return max(part) if part else None


def uses(expr: tirx.Expr, var: tirx.Var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def _stride(expr: tirx.Expr, var: tirx.Var) -> int | None:
    coef = detect_linear_equation(expr, [var])
    return int(coef[0]) if len(coef) == 2 and isinstance(coef[0], tirx.IntImm) else None


def _contains_if(block: s_tir.SBlock) -> bool:
    return "if_then_else" in block.body.script()


def iter_loops(sch: s_tir.Schedule, block_rv) -> list[tuple[str, tirx.Var, object, int]] | None:
    """``(kind, block var, loop rv, extent)`` per loop when loops map 1:1 onto block vars."""
    block = sch.get(block_rv)
    loops = sch.get_loops(block_rv)
    values = list(get_realize(sch, block_rv).iter_values)
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


def is_reduction(sch: s_tir.Schedule, block_rv) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(block_rv).iter_vars)


def inline_producers(sch: s_tir.Schedule) -> None:
    """Inline elementwise intermediates (not outputs, no branches) into their consumers."""
    root = sch.get_sblock("root")
    changed = True
    while changed:
        changed = False
        outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
        for b in sch.get_child_blocks(root):
            block = sch.get(b)
            if (block.name_hint in outputs or is_reduction(sch, b) or _contains_if(block)
                    or not sch.get_consumers(b)):
                continue
            try:
                sch.compute_inline(b)
                changed = True
                break
            except SCHEDULE_ERRORS:
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
    vf = vector_factor(extent, lanes)
    if vf == extent:
        sch.vectorize(loop)
        return None
    outer, inner = sch.split(loop, [None, vf or lanes])
    sch.vectorize(inner)
    return outer


def schedule_spatial(sch: s_tir.Schedule, block_rv, lanes: int) -> None:
    info = iter_loops(sch, block_rv)
    if info is None:
        raise CannotSchedule("loops do not map onto block vars")
    if not info:
        return  # an opaque block (scatter_nd's): its loops are its own, left as they are
    extents = [e for _, _, _, e in info]
    total = math.prod(extents)
    loops = [lp for _, _, lp, _ in info]
    rest = _vectorize_last(sch, loops[-1], extents[-1], lanes) if extents[-1] > 1 else loops[-1]
    outer = loops[:-1] + ([rest] if rest is not None and extents[-1] > 1 else [])
    outer_ext = [int(sch.get(lp).extent) for lp in outer]
    _parallel_outer(sch, outer, outer_ext, total)


def schedule_reduction_plain(sch: s_tir.Schedule, block_rv) -> None:
    """A reduction the register tile does not fit (e.g. a channel mean): parallel outer axes."""
    info = iter_loops(sch, block_rv)
    if info is None:
        raise CannotSchedule("loops do not map onto block vars")
    lead = [(lp, e) for _, _, lp, e in itertools.takewhile(lambda t: t[0] == "S", info)]
    total = math.prod(e for _, e in lead) * math.prod(e for k, _, _, e in info if k == "R")
    if len(lead) > 1:  # the innermost stays serial: no div/mod of a fused index per element
        lead = lead[:-1]
    _parallel_outer(sch, [lp for lp, _ in lead], [e for _, e in lead], total)


def _vector_reads(block: s_tir.SBlock, vvar: tirx.Var) -> list[list[tirx.Expr]] | None:
    """The indices of the reads that depend on the vector axis ``vvar``; None unless it is the
    last non-unit index of the output and only ever the last index of those reads."""
    w_idx = [r.min for r in block.writes[0].region if not (
        isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 and not uses(r.min, vvar))]
    if not w_idx or not w_idx[-1].same_as(vvar):
        return None
    vec_reads = []
    for r in block.reads:
        idx = [x.min for x in r.region]
        hits = [i for i, e in enumerate(idx) if uses(e, vvar)]
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
        if i == vi or ext <= 1 or any(uses(e, var) for idx in vec_reads for e in idx):
            continue
        f = max(d for d in divisors(ext) if d <= limit)
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
    if not outer:  # one vector of outputs (a vector times a matrix): a unit loop around it
        o, vec_loop = sch.split(vec_loop, [1, None])
        outer.append(o)
    sch.reorder(*outer, *[lp for _, lp, _ in reduce_], *inner, vec_loop)
    return sch.fuse(*outer) if len(outer) > 1 else outer[0]


def _accumulate_in_tile(sch: s_tir.Schedule, block_rv, fused, rf: int) -> None:
    """Accumulate in a tile-sized buffer; the epilogue (bias, relu) rides on its write-back."""
    wb = sch.cache_write(block_rv, 0, "global")
    inline_epilogue(sch, wb)
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


def schedule_anchor(sch: s_tir.Schedule, block_rv, isa: VectorISA,
                     weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """Register-tile a reduction whose output's innermost axis can be vectorized. A matrix
    product's ``w[k, n]`` that is a weight of the model (a parameter at a position in
    ``weights``) is read packed as ``w[n // vf, k, n % vf]``, one vector tile's columns
    contiguous (``prepack_weights`` packs it at build; ``(position, vf, "col")`` is
    returned): unpacked, each ``k`` of a tile's reduction reads a row of the matrix away,
    a page or more for 1000+ columns (resnet50's classifier 1.0 -> 0.56 ms, AVX-512)."""
    info = iter_loops(sch, block_rv)
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
    vf = vector_factor(vext, isa.lanes())
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


def param_position(sch: s_tir.Schedule, buffer) -> int | None:
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
        position = param_position(sch, r.source)
        if position in weights and int(r.source.shape[1]) % vf == 0:
            sch.transform_layout(block_rv, ("read", i), lambda k, c: (c // vf, k, c % vf))
            return position, vf, "col"
    return None


def inline_epilogue(sch: s_tir.Schedule, wb) -> None:
    """Fold the elementwise consumers of ``wb`` (bias, relu, a residual add) into it."""
    while True:
        consumers = sch.get_consumers(wb)
        if len(consumers) != 1 or is_reduction(sch, consumers[0]):
            return
        try:
            sch.reverse_compute_inline(consumers[0])
        except SCHEDULE_ERRORS:
            return


def find_block(sch: s_tir.Schedule, name: str):
    try:
        return sch.get_sblock(name)
    except SCHEDULE_ERRORS:  # inlined into another block
        return None


def schedule_window(sch: s_tir.Schedule, block_rv) -> bool:
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
    info = iter_loops(sch, block_rv)
    if info is None or not re.fullmatch(r"S+R+", "".join(k for k, _, _, _ in info)):
        return False
    last = [v for k, v, _, _ in info if k == "S"][-1]
    strides = [_stride(r.region[-1].min, last) for r in block.reads]
    if max((st or 0) for st in strides) < 2:
        return False  # stride 1 (inception's 3x3/1 pools): 0.06 -> 0.38 ms this way
    sch.compute_inline(pads[0])
    info = iter_loops(sch, block_rv)
    spatial = [lp for k, _, lp, _ in info if k == "S"]
    reduce_ = [lp for k, _, lp, _ in info if k == "R"]
    sch.reorder(*spatial[:-1], *reduce_, spatial[-1])
    outer = sch.fuse(*spatial[:-1]) if len(spatial) > 2 else spatial[0]
    sch.parallel(outer)
    sch.decompose_reduction(block_rv, reduce_[0])
    return True
