"""The default CPU schedule of a kernel that normalizes rows: reductions along the last axis
and the elementwise ops that read them (LayerNorm, RMSNorm, Softmax, a masked softmax),
``cpu_schedule`` tries it on such functions before the per-block schedules.

Unscheduled, each of these blocks sweeps the whole tensor once (and generic schedules keep
that order, the reductions on one core): a LayerNorm reads its input three times from memory,
a Softmax writes and reads its exponentials. Here every block is computed per row, inside one
parallel loop over the rows, so a row is read from memory once and stays in cache for the
passes over it (its exponentials live in a row-sized buffer). Each reduction over the row is
split into ``lanes`` partial results (``rfactor``) so that it vectorizes, then summed.
Elementwise intermediates with one consumer are inlined; one read by several (a Softmax's
exponentials, a LayerNorm's mean) is computed once per row.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from hgrt.devices import VectorISA
from hgrt.relay_passes.inner.cpu_schedule_blocks import (
    MIN_PARALLEL_WORK,
    CannotSchedule,
    get_realize,
    is_reduction,
    iter_loops,
    uses,
    vector_factor,
)
from hgrt.relay_passes.inner.cpu_schedule_conv import PEEL_HINT

__all__ = ["schedule_rows"]


def _row_reduction(sch: s_tir.Schedule, block_rv, cols: int) -> bool:
    """Whether ``block_rv`` reduces one axis of at most ``cols`` elements (a row, or a part of
    it), its innermost, which its reads index only as their last index."""
    info = iter_loops(sch, block_rv)
    if not info or "".join(k for k, _, _, _ in info) != "S" * (len(info) - 1) + "R":
        return False
    _, var, _, ext = info[-1]
    if ext > cols:
        return False
    for r in sch.get(block_rv).reads:
        idx = [x.min for x in r.region]
        if any(uses(e, var) for e in idx[:-1]) or idx and uses(idx[-1], var) and not \
                _offset_of(idx[-1], var):
            return False
    return True


def _offset_of(expr, var) -> bool:
    """Whether ``expr`` is ``var`` or ``var`` plus a constant (a row's last values)."""
    if expr.same_as(var):
        return True
    return isinstance(expr, tirx.Add) and (
        expr.a.same_as(var) and isinstance(expr.b, tirx.IntImm)
        or expr.b.same_as(var) and isinstance(expr.a, tirx.IntImm))


def _inline_single_use(sch: s_tir.Schedule, root) -> None:
    """Inline elementwise intermediates that one block reads (a copy per row of the others)."""
    changed = True
    while changed:
        changed = False
        outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(root)}
        for b in sch.get_child_blocks(root):
            if (sch.get(b).name_hint in outputs or is_reduction(sch, b)
                    or len(sch.get_consumers(b)) != 1):
                continue
            try:
                sch.compute_inline(b)
            except (RuntimeError, ValueError):
                continue
            changed = True
            break


def _split_reduction(sch: s_tir.Schedule, block_rv, lanes: int):
    """Reduce the row through ``lanes`` partial results (``partial[l] += x[o * lanes + l]``,
    then a sum of the partials): the partial block, or None where the row fills no two
    vectors or no whole ones (``rfactor`` of a split that does not divide drops its
    predicate: the partial results would read past the row)."""
    loops = sch.get_loops(block_rv)
    ext = int(sch.get(loops[-1]).extent)
    if ext % lanes or ext < 2 * lanes:
        return None
    _, ki = sch.split(loops[-1], [None, lanes])
    return sch.get(sch.rfactor(ki, 0)).name_hint


def _vectorize_partial(sch: s_tir.Schedule, partial, lanes: int) -> None:
    """The lanes loop of a partial reduction innermost and vectorized, its init before the
    reduction loop."""
    block = sch.get(partial)
    values = list(get_realize(sch, partial).iter_values)
    lanes_var = next(v for iv, v in zip(block.iter_vars, values, strict=True)
                     if int(iv.iter_type) == 0 and int(iv.dom.extent) == lanes)
    reduce_var = next(v for iv, v in zip(block.iter_vars, values, strict=True)
                      if int(iv.iter_type) == 2)
    loops = sch.get_loops(partial)
    lanes_loop = next(lp for lp in loops if lanes_var.same_as(sch.get(lp).loop_var))
    reduce_loop = next(lp for lp in loops if reduce_var.same_as(sch.get(lp).loop_var))
    sch.reorder(reduce_loop, lanes_loop)
    sch.vectorize(lanes_loop)
    sch.decompose_reduction(partial, reduce_loop)  # the init inherits the vector loop


def _vectorize_spatial(sch: s_tir.Schedule, block_rv, lanes: int) -> None:
    """The row's innermost loop in vectors: of a divisor of its length (``vector_factor``),
    else of whole registers with the last one partial, peeled off at lowering."""
    loops = sch.get_loops(block_rv)
    ext = int(sch.get(loops[-1]).extent)
    vf = vector_factor(ext, lanes)
    if vf is None or (vf < lanes and ext >= 2 * lanes):
        if ext < 2 * lanes:
            return
        outer, inner = sch.split(loops[-1], [None, lanes])
        sch.vectorize(inner)
        sch.annotate(outer, PEEL_HINT, 1)
        return
    if vf < ext:
        loops = sch.split(loops[-1], [None, vf])
    sch.vectorize(loops[-1])


def schedule_rows(sch: s_tir.Schedule, isa: VectorISA, cores: int) -> bool:
    """Schedule the whole function row by row (see the module's docstring); False when it is
    not made of row reductions and elementwise ops over the same rows. Raises a schedule
    error or ``CannotSchedule`` half-way (the caller works on a copy)."""
    root = sch.get_sblock("root")
    outs = sch.get_output_blocks(root)
    if len(outs) != 1:
        return False
    out_info = iter_loops(sch, outs[0])
    if not out_info or len(out_info) < 2 or any(k != "S" for k, _, _, _ in out_info):
        return False
    cols = out_info[-1][3]
    reductions = [b for b in sch.get_child_blocks(root) if is_reduction(sch, b)]
    if cols < isa.lanes() or not reductions or not all(
            _row_reduction(sch, b, cols) for b in reductions):
        return False
    _inline_single_use(sch, root)
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(root) if is_reduction(sch, b)]
    partials = [p for n in names if (p := _split_reduction(sch, sch.get_sblock(n),
                                                            isa.lanes())) is not None]
    out = sch.get_output_blocks(root)[0]
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    blocks = [b for b in sch.get_child_blocks(root) if not sch.get(b).same_as(sch.get(out))]
    for b in reversed(blocks):
        sch.compute_at(b, row, preserve_unit_loops=True)
    for b in sch.get_child_blocks(root):  # nothing swept more than once per row
        if math.prod(int(sch.get(lp).extent) for lp in sch.get_loops(b)[1:]) > cols:
            raise CannotSchedule(f"block {sch.get(b).name_hint} is not row-local")
    rows = int(sch.get(row).extent)
    if cores > 1 and rows > 1 and rows * cols >= MIN_PARALLEL_WORK:
        sch.parallel(row)
    for name in partials:
        _vectorize_partial(sch, sch.get_sblock(name), isa.lanes())
    for b in sch.get_child_blocks(root):
        if not is_reduction(sch, b) and len(sch.get_loops(b)) > 1:
            _vectorize_spatial(sch, b, isa.lanes())
    return True
