"""The tuning database: the schedules ``hgrt tune`` wrote, put back into a fused module
(``apply_database``, which the ``apply_tuning`` pass runs).

A record applies to a kernel when both its structural hash and its target (kind, mcpu, mattr,
arch; not the core count) agree. A database tuned for another CPU is an error when the user named
it (``build(tuning_db=)``, ``--tuning-db``), and ignored with a warning by ``apply_database``
called without ``explicit``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import relax, tirx

from hgrt.devices import kind_of
from hgrt.errors import BuildError
from hgrt.relay_passes.inner.cpu_schedule_conv import PEEL_HINT, peel_ragged_tiles
from hgrt.relay_passes.util.relax_util import func_target, is_scheduled, prim_funcs

RECORDS_FILE = "database_tuning_record.json"


def target_key(target: tvm.target.Target) -> tuple:
    """What must agree for a record to apply: the code it was timed as (not the core count)."""
    a = target.attrs
    mattr = tuple(sorted(str(x) for x in a["mattr"])) if "mattr" in a else ()
    return (target.kind.name, str(a.get("mcpu", "")) if "mcpu" in a else "", mattr,
            str(a["arch"]) if "arch" in a else "")


# attrs a tuning record never carries: lowering adds them (``op_pattern`` for the graph; a
# database tuned before it was added still matches)
_NOT_RECORDED = ("target", "op_pattern")


def _without(func: tirx.PrimFunc, attrs: tuple[str, ...]) -> tirx.PrimFunc:
    for attr in attrs:
        if func.attrs is not None and attr in func.attrs:
            func = func.without_attr(attr)
    return func


def bare_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` without the attrs that differ between a module's copy and a record's."""
    return _without(func, ("global_symbol", "tirx.noalias", *_NOT_RECORDED))


def kernel_key(func: tirx.PrimFunc, target: tvm.target.Target) -> str:
    """A kernel of a fused module: its target (``target_key``) and its structural hash."""
    return f"{'/'.join(map(str, target_key(target)))}|{tvm_ffi.structural_hash(bare_func(func))}"


def module_targets(mod: tvm.IRModule) -> list[tvm.target.Target]:
    """The distinct targets (by ``target_key``) of the PrimFuncs of a fused module."""
    seen: dict[tuple, tvm.target.Target] = {}
    for f in prim_funcs(mod).values():
        if func_target(f) is not None:
            seen.setdefault(target_key(f.attrs["target"]), f.attrs["target"])
    return list(seen.values())


def functions_for(mod: tvm.IRModule, target: tvm.target.Target) -> dict[str, tirx.PrimFunc]:
    """PrimFuncs that run on ``target`` (their ``target`` attr, or none), without the attrs
    that records never carry: ``target``, and ``op_pattern`` (lowering adds it for the graph;
    databases tuned before it was added still match)."""
    key = target_key(target)
    return {name: as_recorded(f) for name, f in prim_funcs(mod).items()
            if target_key(func_target(f, target)) == key}


def as_recorded(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` without the attrs a tuning record never carries (see ``functions_for``)."""
    return _without(func, _NOT_RECORDED)


def open_database(db_dir: str):
    """The MetaSchedule JSON database in ``db_dir`` (created when missing)."""
    from tvm.s_tir import meta_schedule as ms

    _refuse_a_file(db_dir)
    os.makedirs(db_dir, exist_ok=True)
    try:
        return ms.database.JSONDatabase(work_dir=db_dir, module_equality="structural")
    except Exception as e:  # a line that is not a record: TVM says only what it could not parse
        files = sorted(f for f in os.listdir(db_dir) if f.startswith("database_"))
        raise BuildError(f"tuning database {db_dir!r}: its files {files} do not read as "
                         f"MetaSchedule records ({type(e).__name__}: {str(e)[:200]}); mend or "
                         f"remove the damaged file and tune again") from None


def _refuse_a_file(db_dir: str) -> None:
    if os.path.exists(db_dir) and not os.path.isdir(db_dir):
        raise BuildError(f"tuning database {db_dir!r} is a file; a database is a directory "
                         f"(what `hgrt tune --db DIR` writes)")


class TuningProgress:
    """``hgrt_progress.json`` in the database: per (target, workload hash), the trials a
    finished tune of that task asked for, and per kernel whether its default schedule wins."""

    FILE = "hgrt_progress.json"

    def __init__(self, db_dir: str) -> None:
        self.path = os.path.join(db_dir, self.FILE)
        self.asked_by_key: dict[str, int] = {}
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return  # no task tuned yet
        try:
            read = json.loads(raw)
            ok = isinstance(read, dict) and all(isinstance(v, int) for v in read.values())
        except ValueError:
            ok = False
        if not ok:  # read as empty, every verdict would be lost and every task tuned again
            raise BuildError(f"{self.path} is damaged (not a JSON object of counts): remove it "
                             f"to start the progress afresh (the tuning records stay)")
        self.asked_by_key = read

    @staticmethod
    def _key(task_mod: tvm.IRModule, target: tvm.target.Target, what: str) -> str:
        return (f"{'/'.join(map(str, target_key(target)))}|"
                f"{tvm_ffi.structural_hash(task_mod)}|{what}")

    def asked(self, task_mod: tvm.IRModule, target: tvm.target.Target, what: str = "trials") -> int:
        return int(self.asked_by_key.get(self._key(task_mod, target, what), 0))

    def record(self, task_mod: tvm.IRModule, target: tvm.target.Target, trials: int,
               what: str = "trials") -> None:
        key = self._key(task_mod, target, what)
        self.asked_by_key[key] = max(trials, self.asked_by_key.get(key, 0))
        self._save()

    def default_wins(self) -> set[str]:
        """Kernels (``kernel_key``) whose tuned schedule ran slower in the model than the
        default one when ``hgrt.tune.verify_in_model`` last ran."""
        return {k.rsplit("|", 1)[0] for k, v in self.asked_by_key.items()
                if k.endswith("|default_wins") and v}

    def set_default_wins(self, keys: set[str], scope: set[str] | None = None) -> None:
        """Record ``keys`` as the kernels whose default schedule wins, replacing the verdicts
        on the kernels of ``scope`` (default: all; several models may share a database)."""
        self.asked_by_key = {k: v for k, v in self.asked_by_key.items()
                             if not k.endswith("|default_wins") or (
                                 scope is not None and k.rsplit("|", 1)[0] not in scope)}
        self.asked_by_key.update({f"{k}|default_wins": 1 for k in keys})
        self._save()

    def _save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.asked_by_key, f, indent=0, sort_keys=True)
        os.replace(tmp, self.path)


@dataclass
class ApplyReport:
    """Which kernels ``apply_database`` scheduled from the database, and which fell back."""

    db_dir: str
    tuned: dict[str, str] = field(default_factory=dict)  # kernel -> target it was tuned for
    fallback: list[str] = field(default_factory=list)
    default_faster: list[str] = field(default_factory=list)  # of fallback: verified in the model
    ignored_records: int = 0  # records for targets this module does not build for

    def summary(self) -> str:
        n = len(self.tuned) + len(self.fallback)
        s = f"tuned {len(self.tuned)} of {n} kernels from {self.db_dir}"
        if self.fallback:
            shown = ", ".join(self.fallback[:8]) + (" …" if len(self.fallback) > 8 else "")
            s += f"; {len(self.fallback)} fall back to the default schedule ({shown})"
        if self.default_faster:
            s += (f" ({len(self.default_faster)} of them because the default schedule ran "
                  f"faster in the model)")
        if self.ignored_records:
            s += f"; {self.ignored_records} records for other targets ignored"
        return s


def _short(target: tvm.target.Target) -> str:
    """A target as its ``target_key`` sees it, in TVM's option spelling (``as_target`` reads
    it back): ``llvm -mcpu=haswell``."""
    a = target.attrs
    mattr = ",".join(sorted(str(x) for x in a["mattr"])) if "mattr" in a else ""
    return f"{target.kind.name}" + (f" -mcpu={a['mcpu']}" if "mcpu" in a else "") + (
        f" -mattr={mattr}" if mattr else "") + (f" -arch={a['arch']}" if "arch" in a else "")


def _records_by_target(db_dir: str, targets: list[tvm.target.Target], report: ApplyReport):
    """The records of ``db_dir`` in one in-memory database per target of ``targets`` (by
    ``target_key``), and the targets of the records that fit none of them."""
    from tvm.s_tir import meta_schedule as ms

    per_target = {target_key(t): ms.database.MemoryDatabase(module_equality="structural")
                  for t in targets}
    found: dict[tuple, int] = {key: 0 for key in per_target}
    others: dict[tuple, tvm.target.Target] = {}
    for rec in open_database(db_dir).get_all_tuning_records():
        key = target_key(rec.target)
        db = per_target.get(key)
        if db is None:
            report.ignored_records += 1
            others.setdefault(key, rec.target)
            continue
        found[key] += 1
        db.commit_tuning_record(ms.database.TuningRecord(
            rec.trace, db.commit_workload(rec.workload.mod), rec.run_secs, rec.target,
            rec.args_info))
    return per_target, found, list(others.values())


def _check_targets(db_dir: str, targets: list[tvm.target.Target], found: dict[tuple, int],
                   others: list[tvm.target.Target], ignored: int, explicit: bool) -> None:
    """A build target without a record in the database, which has records for another target
    of that kind, means the database was tuned for another CPU (or GPU): a BuildError when the
    user named the database (``explicit``), else a warning, as records of targets the build
    does not use are."""
    missed = [t for t in targets if not found[target_key(t)]
              and any(o.kind.name == t.kind.name for o in others)]
    if missed and explicit:
        t = missed[0]
        theirs = sorted({_short(o) for o in others if o.kind.name == t.kind.name})
        kind = kind_of(t).name
        raise BuildError(
            f"tuning database {db_dir!r} was tuned for {theirs}, but this build is for "
            f"{_short(t)!r}: none of its schedules apply. Build for the database's target "
            f"(target={{{kind!r}: {theirs[0]!r}}}; on the command line --target "
            f"'{kind}={theirs[0]}') or tune for this one (`hgrt tune`)")
    if others:
        warnings.warn(f"tuning database {db_dir!r}: {ignored} records for other targets "
                      f"({sorted({_short(o) for o in others})}) ignored; building for "
                      f"{sorted(_short(t) for t in targets)}", stacklevel=3)


def apply_database(mod: tvm.IRModule, db_dir: str, *, log: Callable[[str], None] | None = None,
                   use_verdicts: bool = True, explicit: bool = False
                   ) -> tuple[tvm.IRModule, ApplyReport]:
    """Give every kernel of the fused ``mod`` that ``db_dir`` has a record for its tuned
    schedule (marked ``tirx.is_scheduled``); returns the module and who was tuned / fell back.

    ``relax.transform.MetaScheduleApplyDatabase`` runs once per target of the module over that
    target's kernels. A kernel whose tuned schedule ran slower inside the model than the
    default one (``hgrt.tune.verify_in_model``) keeps the default; ``use_verdicts=False``
    applies every record regardless. A database tuned for another target of a kind the module
    builds for (another ``mcpu``) is a BuildError when ``explicit`` (the user named it: every
    ``build(tuning_db=)``), else ignored with a warning.
    """
    _refuse_a_file(db_dir)
    if not os.path.exists(os.path.join(db_dir, RECORDS_FILE)):
        raise BuildError(f"tuning database {db_dir!r} does not exist (no {RECORDS_FILE}): "
                         f"run `hgrt tune` first")
    report = ApplyReport(db_dir=db_dir)
    targets = module_targets(mod)
    per_target, found, others = _records_by_target(db_dir, targets, report)
    _check_targets(db_dir, targets, found, others, report.ignored_records, explicit)
    default_wins = TuningProgress(db_dir).default_wins() if use_verdicts else set()
    new = mod.clone()
    for target in targets:
        mine = functions_for(mod, target)
        with target, per_target[target_key(target)], tvm.transform.PassContext(opt_level=3):
            applied = relax.transform.MetaScheduleApplyDatabase()(tvm.IRModule(mine))
        for name in sorted(mine):
            f = applied[name]
            if kernel_key(mine[name], target) in default_wins:
                report.fallback.append(name)
                report.default_faster.append(name)
            elif is_scheduled(f) and not tvm_ffi.structural_equal(f, mine[name]):
                pattern = (mod[name].attrs or {}).get("op_pattern")
                f = f.with_attr("target", target)
                if PEEL_HINT in f.script():  # hgrt's default schedule won: its peeled tiles
                    f = peel_ragged_tiles(f)
                new.update_func(new.get_global_var(name), f if pattern is None
                                else f.with_attr("op_pattern", pattern))
                report.tuned[name] = _short(target)
            else:
                report.fallback.append(name)
    if log:
        log(report.summary())
    return (new if report.tuned else mod), report
