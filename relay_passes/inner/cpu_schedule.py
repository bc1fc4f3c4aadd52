"""The default CPU schedule (what the ``schedule_cpu`` pass gives every CPU PrimFunc that
MetaSchedule did not tune), cheap and deterministic.

Unscheduled TIR (LegalizeOps → FuseTIR output) runs on one core, scalar. This schedule gives each
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
  ``schedule_pointwise``, ``cpu_schedule_conv``);
- every other block: outer loops fused and parallel, innermost vectorized.

Functions it cannot schedule are left as they are and counted (``ScheduleReport.skipped``).
Results never change: only schedule primitives are used, and each is checked by TVM.

>>> mod, report = schedule_cpu_functions(fused_mod, host_target())  # doctest: +SKIP
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import tvm
from tvm import s_tir, tirx

from hgrt.devices import VectorISA, vector_isa
from hgrt.relay_passes.inner.cpu_schedule_blocks import (
    SCHEDULE_ERRORS,
    CannotSchedule,
    find_block,
    inline_producers,
    is_reduction,
    schedule_anchor,
    schedule_reduction_plain,
    schedule_spatial,
    schedule_window,
)
from hgrt.relay_passes.inner.cpu_schedule_conv import (
    PEEL_HINT,
    STAGED,
    peel_ragged_tiles,
    schedule_conv,
    schedule_depthwise,
    schedule_pointwise,
)
from hgrt.relay_passes.inner.cpu_schedule_matmul import schedule_matmul
from hgrt.relay_passes.inner.cpu_schedule_rows import schedule_rows
from hgrt.relay_passes.util.relax_util import SCHEDULED_ATTR, func_target, is_scheduled, prim_funcs

__all__ = ["ScheduleReport", "default_schedule_trace", "schedule_cpu_functions"]

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
    # name → the rules its blocks got: "rows" (the whole function, row by row), "conv",
    # "matmul", "window", "tile" (the generic register tile), "reduction" (outer loops
    # parallel only), "spatial"
    rules: dict[str, list[str]] = field(default_factory=dict)
    not_cpu: list[str] = field(default_factory=list)  # another target's, untouched
    # name → (parameter position, lanes, layout): a weight it reads packed (``prepack_weights``)
    prepacked: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"default CPU schedule: {len(self.scheduled)} scheduled ({len(self.tiled)} "
                f"register-tiled, {len(self.prepacked)} with prepacked weights), "
                f"{len(self.skipped)} skipped, {len(self.not_cpu)} not CPU")


def _scalar_only_call(func: tirx.PrimFunc) -> str | None:
    """The first intrinsic of ``_SCALAR_ONLY`` that ``func`` calls, if any."""
    found = _SCALAR_ONLY.search(func.script())
    return f"tirx.{found.group(1)}" if found else None


def _cores(target: tvm.target.Target) -> int:
    return int(target.attrs.get("num-cores", 1) or 1)


def default_schedule_trace(func: tirx.PrimFunc, target: tvm.target.Target) -> s_tir.Trace | None:
    """The default schedule of one PrimFunc as a schedule trace (what ``hgrt tune`` measures
    and records next to MetaSchedule's candidates), or None when it cannot be scheduled."""
    try:
        sch, _, _ = _default_schedule(func, vector_isa(target), _cores(target))
    except (*SCHEDULE_ERRORS, CannotSchedule):
        return None
    return sch.trace


def _on_copy(sch: s_tir.Schedule, name: str, schedule, *args
             ) -> tuple[s_tir.Schedule, object] | None:
    """``(copy of sch, what schedule returned)`` after ``schedule(copy, block name, *args)``;
    None when it returned a falsy value or a primitive failed half-way (``sch`` untouched)."""
    trial = sch.copy()
    try:
        done = schedule(trial, trial.get_sblock(name), *args)
    except (*SCHEDULE_ERRORS, CannotSchedule):
        return None
    return (trial, done) if done else None


def _rows(sch: s_tir.Schedule, isa: VectorISA, cores: int) -> s_tir.Schedule | None:
    """A copy of ``sch`` scheduled row by row (``schedule_rows``), or None where that does
    not apply."""
    trial = sch.copy()
    try:
        return trial if schedule_rows(trial, isa, cores) else None
    except (*SCHEDULE_ERRORS, CannotSchedule):
        return None


def _default_schedule(func: tirx.PrimFunc, isa: VectorISA, cores: int = 1,
                      weights: frozenset[int] = frozenset(), rules: set[str] | None = None
                      ) -> tuple[s_tir.Schedule, bool, tuple[int, int, str] | None]:
    """The default schedule of ``func``, whether a register tile was used, and the weight
    parameter that takes a packed layout (``schedule_conv``, ``schedule_matmul``), if any;
    ``rules`` gets the rules its blocks got (``ScheduleReport.rules``)."""
    rules = set() if rules is None else rules
    if (op := _scalar_only_call(func)) is not None:
        raise CannotSchedule(f"calls {op}, which LLVM cannot emit on vectors")
    sch = s_tir.Schedule(func)
    if (rows := _rows(sch, isa, cores)) is not None:
        rules.add("rows")
        return rows, False, None
    prepacked = None
    inline_producers(sch)
    tiled = False
    done: set[str] = set()
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    for name in names:  # anchors first: they absorb their epilogues
        b = find_block(sch, name)
        if b is None or not is_reduction(sch, b):
            continue
        how: tuple[int, int, str] | bool = False
        conv = (_on_copy(sch, name, schedule_pointwise, isa, cores, weights)
                or _on_copy(sch, name, schedule_conv, isa, cores, weights)
                or _on_copy(sch, name, schedule_depthwise, isa, cores, weights))
        rule = "conv"
        if conv is not None:
            sch, how = conv
        elif (mm := _on_copy(sch, name, schedule_matmul, isa, cores, weights)) is not None:
            sch, how, rule = *mm, "matmul"
        elif (window := _on_copy(sch, name, schedule_window)) is not None:
            sch, rule = window[0], "window"
        elif (how := schedule_anchor(sch, b, isa, weights)):
            rule = "tile"
        else:
            schedule_reduction_plain(sch, sch.get_sblock(name))
            rule = "reduction"
        rules.add(rule)
        if how:
            tiled = True
            if isinstance(how, tuple) and prepacked is not None:
                rules.clear()  # one packed weight per function
                return _default_schedule(func, isa, cores, frozenset(), rules)
            if isinstance(how, tuple):
                prepacked = how
        done.add(name)
    for name in names:
        b = find_block(sch, name)
        if b is None or name in done or is_reduction(sch, b):
            continue
        if STAGED in sch.get(b).annotations:
            continue  # scheduled with its convolution
        schedule_spatial(sch, b, isa.lanes())
        rules.add("spatial")
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
            rules: set[str] = set()
            sch, tiled, packed = _default_schedule(func, vector_isa(ftarget), _cores(ftarget),
                                                   frozenset((weights or {}).get(name, ())),
                                                   rules)
        except (*SCHEDULE_ERRORS, CannotSchedule) as e:
            report.skipped[name] = str(e).strip().splitlines()[0][:200] if str(e) else "error"
            continue
        if new is None:
            new = mod.clone()
        scheduled = sch.mod["main"]
        if PEEL_HINT in str(sch.trace):
            scheduled = peel_ragged_tiles(scheduled)
        new.update_func(new.get_global_var(name), scheduled.with_attr(SCHEDULED_ATTR, True))
        report.scheduled.append(name)
        report.rules[name] = sorted(rules)
        if tiled:
            report.tiled.append(name)
        if packed is not None:
            report.prepacked[name] = packed
    return (mod if new is None else new), report
