"""``hgrt.tune``: MetaSchedule tuning of a model's fused kernels into a JSON database, and
``apply_database``: the tuned schedules put back into a fused module before it is built.

>>> mod = fuse_for_tuning("model.onnx")  # doctest: +SKIP
>>> tune(mod, host_target(), "tuning/", trials_per_task=16)  # doctest: +SKIP
task 1/18 fused_conv2d_add_relu (weight 1): 16 trials, best 0.412 ms
>>> mod, report = apply_database(mod, host_target(), "tuning/")  # doctest: +SKIP
>>> print(report.summary())  # doctest: +SKIP
tuned 18 of 38 kernels from tuning/; 20 fall back to the default schedule

A task is one distinct fused PrimFunc (structural hash) for one target: a function placed on two
devices of two targets is tuned once per target. Records are matched by that hash and by the
target (kind, mcpu, mattr, arch): a database tuned for another CPU is ignored with a warning.
Tuning is resumable: a task that already has ``trials_per_task`` measured records in the
database is skipped, one with fewer gets only the missing trials, and every record is appended
to the same JSON files (MetaSchedule writes a task's records when its round finishes).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import relax, tirx

from hgrt.errors import BuildError

__all__ = ["ApplyReport", "TuneSummary", "apply_database", "fuse_for_tuning", "tune",
           "tuning_tasks"]

# registered in each builder worker by _builder_initializer: tvm.build without the
# `import tvm.s_tir.tensor_intrin` of MetaSchedule's default_build (~46 s per worker here)
BUILD_FUNC = "hgrt.tune.build_without_tensor_intrin"


def _builder_initializer() -> None:
    import tvm_ffi

    def build(mod, target, _params):
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
        return tvm_build(mod, target=target)

    tvm_ffi.register_global_func(BUILD_FUNC, build, override=True)


def _lowering() -> tvm.transform.Pass:
    return tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(["main"]),
    ])


def fuse_for_tuning(model: Any, params: dict[str, Any] | None = None,
                    target: tvm.target.Target | str = "llvm") -> tvm.IRModule:
    """A model (ONNX path / ModelProto, Relax IRModule) → the fused module ``lower`` makes.

    The same passes as ``hgrt.relay_passes.lower`` (one device), so the fused functions and
    their structural hashes are the ones the compiler looks up.
    """
    from hgrt.frontend import import_model

    if isinstance(model, tvm.IRModule) and _is_fused(model):
        return model
    mod, _ = import_model(model, params)
    with tvm.target.Target(target), tvm.transform.PassContext(opt_level=3):
        return _lowering()(mod)


def _is_fused(mod: tvm.IRModule) -> bool:
    return any(isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items())


def _target_key(target: tvm.target.Target) -> tuple:
    """What must agree for a record to apply: the code it was timed as (not the core count)."""
    a = target.attrs
    mattr = tuple(sorted(str(x) for x in a["mattr"])) if "mattr" in a else ()
    return (target.kind.name, str(a.get("mcpu", "")) if "mcpu" in a else "", mattr,
            str(a["arch"]) if "arch" in a else "")


def _func_target(func: tirx.PrimFunc, default: tvm.target.Target) -> tvm.target.Target:
    return func.attrs["target"] if func.attrs is not None and "target" in func.attrs else default


def _functions_for(mod: tvm.IRModule, target: tvm.target.Target) -> dict[str, tirx.PrimFunc]:
    """PrimFuncs that run on ``target`` (their ``target`` attr, or none), attr stripped."""
    key = _target_key(target)
    out = {}
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and _target_key(_func_target(f, target)) == key:
            out[gv.name_hint] = f.without_attr("target") if "target" in (f.attrs or {}) else f
    return out


def _bare(func: tirx.PrimFunc) -> tirx.PrimFunc:
    for attr in ("global_symbol", "target", "tirx.noalias"):
        if func.attrs is not None and attr in func.attrs:
            func = func.without_attr(attr)
    return func


def tuning_tasks(mod: tvm.IRModule, target: tvm.target.Target | str) -> list:
    """MetaSchedule tasks (``ExtractedTask``) of the fused ``mod`` for the kernels on ``target``.

    ``ms.relax_integration.extract_tasks`` dedups by structural hash and weights each task by
    its number of call sites; functions placed on another target are left out.
    """
    from tvm.s_tir import meta_schedule as ms

    target = tvm.target.Target(target)
    mine = _functions_for(mod, target)
    stripped = mod.clone()
    for gv, f in mod.functions_items():
        if isinstance(f, tirx.PrimFunc) and "target" in (f.attrs or {}):
            stripped.update_func(gv, f.without_attr("target"))
    tasks = ms.relax_integration.extract_tasks(stripped, target)
    keep = []
    for t in tasks:
        body = t.dispatched[0]["main"]
        if t.task_name in mine or any(
                tvm_ffi.structural_equal(_bare(body), _bare(f)) for f in mine.values()):
            keep.append(t)
    return keep


@dataclass
class TuneSummary:
    """What ``tune`` did: per task name, trials measured now and the best time (seconds)."""

    db_dir: str
    target: str
    tasks: int = 0
    skipped: list[str] = field(default_factory=list)  # already had enough trials
    trials: dict[str, int] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _database(db_dir: str):
    from tvm.s_tir import meta_schedule as ms

    os.makedirs(db_dir, exist_ok=True)
    return ms.database.JSONDatabase(work_dir=db_dir, module_equality="structural")


def _records(db, task_mod: tvm.IRModule, target: tvm.target.Target) -> list:
    if not db.has_workload(task_mod):
        return []
    key = _target_key(target)
    recs = db.get_top_k(db.commit_workload(task_mod), 1 << 30)
    return [r for r in recs if _target_key(r.target) == key]


def _best(records: list) -> float | None:
    times = [sum(float(x) for x in r.run_secs) / len(r.run_secs) for r in records
             if r.run_secs]
    return min(times) if times else None


def tune(model: Any, targets: Sequence[tvm.target.Target | str] | tvm.target.Target | str,
         db_dir: str, trials_per_task: int = 16, *, params: dict[str, Any] | None = None,
         trials_per_round: int | None = None, population_size: int = 128,
         builder_timeout_sec: float = 60.0, max_workers: int | None = None, seed: int = 0,
         cost_model: str = "random",
         log: Callable[[str], None] | None = print) -> list[TuneSummary]:
    """Tune every distinct kernel of ``model`` for each target into ``db_dir`` (JSON database).

    ``model``: a fused IRModule (what ``lower`` makes, PrimFuncs may carry ``target`` attrs), a
    Relax IRModule or an ONNX model (fused here with ``fuse_for_tuning``). Resumable: run it
    again with the same ``db_dir`` and finished tasks are skipped, unfinished ones continue.
    ``cost_model``: ``"random"`` (no extra dependency) or ``"xgb"`` (needs xgboost; better
    candidates per trial on long tunes).
    """
    from tvm.s_tir import meta_schedule as ms

    log = log or (lambda _m: None)
    if isinstance(targets, (str, dict, tvm.target.Target)):
        targets = [targets]
    targets = [tvm.target.Target(t) for t in targets]
    mod = fuse_for_tuning(model, params, targets[0])
    db = _database(db_dir)
    workers = max_workers or max(1, min(os.cpu_count() or 1, 2))
    builder = ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=_builder_initializer,
                                      timeout_sec=builder_timeout_sec, max_workers=workers)
    runner = ms.runner.LocalRunner(timeout_sec=builder_timeout_sec)
    summaries = []
    for target in targets:
        start = time.perf_counter()
        tasks = tuning_tasks(mod, target)
        summary = TuneSummary(db_dir=db_dir, target=str(target), tasks=len(tasks))
        log(f"tuning {len(tasks)} tasks for {target} into {db_dir} "
            f"({trials_per_task} trials per task)")
        for i, task in enumerate(tasks, 1):
            task_mod = task.dispatched[0]
            done = _records(db, task_mod, target)
            todo = trials_per_task - len(done)
            head = f"task {i}/{len(tasks)} {task.task_name} (weight {task.weight})"
            if todo <= 0:
                best = _best(done)
                summary.skipped.append(task.task_name)
                if best is not None:
                    summary.best[task.task_name] = best
                log(f"{head}: done before ({len(done)} trials), best "
                    f"{best * 1e3:.3f} ms" if best is not None else f"{head}: done before")
                continue
            ctx = ms.TuneContext(
                mod=task_mod, target=target, space_generator="post-order-apply",
                search_strategy=ms.search_strategy.EvolutionarySearch(
                    population_size=population_size, genetic_num_iters=2),
                task_name=task.task_name, rand_state=seed + i + len(done),
                num_threads=workers).clone()
            try:
                ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=db_dir,
                              max_trials_global=todo, max_trials_per_task=todo,
                              num_trials_per_iter=min(trials_per_round or todo, todo),
                              builder=builder, runner=runner, database=db,
                              cost_model=(ms.cost_model.RandomModel() if cost_model == "random"
                                          else cost_model),
                              task_scheduler="round-robin")
            except Exception as e:  # noqa: BLE001 - one task failing must not lose the rest
                log(f"{head}: tuning failed ({str(e).strip().splitlines()[0][:160]})")
                continue
            recs = _records(db, task_mod, target)
            best = _best(recs)
            summary.trials[task.task_name] = len(recs) - len(done)
            if best is not None:
                summary.best[task.task_name] = best
            best_s = f"{best * 1e3:.3f} ms" if best is not None else "no valid trial"
            log(f"{head}: {len(recs) - len(done)} trials ({len(recs)} in db), best {best_s}")
        summary.seconds = time.perf_counter() - start
        log(f"tuned {len(summary.trials)} tasks, {len(summary.skipped)} already done, "
            f"{summary.seconds:.0f} s")
        summaries.append(summary)
    return summaries


@dataclass
class ApplyReport:
    """Which kernels ``apply_database`` scheduled from the database, and which fell back."""

    db_dir: str
    target: str
    tuned: list[str] = field(default_factory=list)
    fallback: list[str] = field(default_factory=list)
    ignored_records: int = 0  # records for other targets

    def summary(self) -> str:
        n = len(self.tuned) + len(self.fallback)
        s = f"tuned {len(self.tuned)} of {n} kernels from {self.db_dir}"
        if self.fallback:
            shown = ", ".join(self.fallback[:8]) + (" …" if len(self.fallback) > 8 else "")
            s += f"; {len(self.fallback)} fall back to the default schedule ({shown})"
        return s


def apply_database(mod: tvm.IRModule, target: tvm.target.Target | str, db_dir: str,
                   *, log: Callable[[str], None] | None = None
                   ) -> tuple[tvm.IRModule, ApplyReport]:
    """Give every kernel of ``mod`` on ``target`` that ``db_dir`` has a record for its tuned
    schedule (marked ``tirx.is_scheduled``); returns the module and who was tuned / fell back.

    Runs ``relax.transform.MetaScheduleApplyDatabase`` (under ``with target, db,
    PassContext(opt_level=3)``) over the target's PrimFuncs with only the records of this
    target; records of other targets are ignored with a warning.
    """
    from tvm.s_tir import meta_schedule as ms

    target = tvm.target.Target(target)
    report = ApplyReport(db_dir=db_dir, target=str(target))
    mine = _functions_for(mod, target)
    if not os.path.isdir(db_dir):
        raise BuildError(f"tuning database {db_dir!r} does not exist")
    db = _database(db_dir)
    key = _target_key(target)
    ok = ms.database.MemoryDatabase(module_equality="structural")
    other_targets = set()
    for rec in db.get_all_tuning_records():
        if _target_key(rec.target) == key:
            ok.commit_workload(rec.workload.mod)
            ok.commit_tuning_record(ms.database.TuningRecord(
                rec.trace, ok.commit_workload(rec.workload.mod), rec.run_secs, rec.target,
                rec.args_info))
        else:
            report.ignored_records += 1
            other_targets.add(str(rec.target.attrs.get("mcpu", rec.target.kind.name))
                              if "mcpu" in rec.target.attrs else rec.target.kind.name)
    if report.ignored_records:
        warnings.warn(f"tuning database {db_dir!r}: {report.ignored_records} records for other "
                      f"targets ({sorted(other_targets)}) ignored; building for {target}",
                      stacklevel=2)
    if not mine:
        return mod, report
    sub = tvm.IRModule(dict(mine.items()))
    with target, ok, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase()(sub)
    new = mod.clone()
    for name in sorted(mine):
        f = applied[name]
        if f.attrs is not None and bool(f.attrs.get("tirx.is_scheduled", False)) and not \
                tvm_ffi.structural_equal(f, mine[name]):
            orig = mod[name]
            if orig.attrs is not None and "target" in orig.attrs:
                f = f.with_attr("target", orig.attrs["target"])
            new.update_func(new.get_global_var(name), f)
            report.tuned.append(name)
        else:
            report.fallback.append(name)
    if log:
        log(report.summary())
    return (new if report.tuned else mod), report
