"""Run passes in order and say where it broke: "'insert_copies' failed after ['place_devices']";
inside a pass, ``located`` adds the binding, its op and device to a failure of TVM's:
"... binding 'lv3' (relax.nn.prelu) on cpu:1: AssertionError", TVM's exception as the cause.

With ``HGRT_VERIFY_IR=1`` (or ``verify=True``) the Relax IR is checked for well-formedness after
every pass, so a pass that produces bad IR is named instead of the pass that trips over it.

Every pass declares its ``Contract``: the ``BuildContext`` fields it reads and writes, and the
passes that must run before it::

    @contract(reads={"devices", "placed", "weights"}, writes={"weights"},
              after=("place_devices",))
    def insert_copies(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule: ...

``check_order`` (run by ``run_passes``, and where ``hgrt.compiler.PASSES`` is defined) refuses a
list that runs a pass too early: "'insert_copies' needs 'place_devices' to run before it, but it
runs after [] (it reads ctx.placed, which 'place_devices' writes)".
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import tvm
from tvm import relax

from hgrt.errors import BuildError, HgrtError, did_you_mean
from hgrt.relay_passes.util.context import BuildContext

Pass = Callable[[Any, Any], Any]
P = TypeVar("P", bound=Pass)

CONTEXT_FIELDS = tuple(f.name for f in dataclasses.fields(BuildContext))


@dataclasses.dataclass(frozen=True)
class Contract:
    """What a pass does with the build context: the ``BuildContext`` fields it ``reads`` and
    ``writes`` (a field changed in place is written: ``ctx.weights.new_param(...)`` writes
    ``weights``), the passes that must have run before it (``after``) and those of the list
    that must run after it (``before``: how a kernel provider's pass, which the passes of the
    house do not name, says where it belongs)."""

    reads: frozenset[str] = frozenset()
    writes: frozenset[str] = frozenset()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()


def contract(*, reads: Iterable[str] = (), writes: Iterable[str] = (),
             after: Sequence[str] = (), before: Sequence[str] = ()) -> Callable[[P], P]:
    """Declare a pass's ``Contract``; the pass is returned as it is, the contract its
    ``contract`` attribute. A name that is no ``BuildContext`` field is refused at once."""
    declared = Contract(frozenset(reads), frozenset(writes), tuple(after), tuple(before))
    for name in sorted(declared.reads | declared.writes):
        if name not in CONTEXT_FIELDS:
            raise TypeError(f"contract: BuildContext field {did_you_mean(name, CONTEXT_FIELDS)}")

    def attach(fn: P) -> P:
        fn.contract = declared  # type: ignore[attr-defined]
        return fn
    return attach


def contract_of(name: str, fn: Pass) -> Contract:
    """``fn``'s declared contract; a pass without one is refused."""
    declared = getattr(fn, "contract", None)
    if not isinstance(declared, Contract):
        raise BuildError(f"pass {name!r} declares no contract (@contract(reads=..., "
                         f"writes=..., after=...) in hgrt.relay_passes.util.pipeline)")
    return declared


def check_order(passes: Sequence[tuple[str, Pass]]) -> None:
    """Refuse ``passes`` unless each runs after every pass its contract names in ``after`` and
    before every pass of the list it names in ``before``: a BuildError names the first pass
    that runs too early (or too late), what it needs and why."""
    contracts = {name: contract_of(name, fn) for name, fn in passes}
    done: list[str] = []
    for name, _ in passes:
        late = [p for p in contracts[name].before if p in done]
        if late:
            raise BuildError(f"'{name}' must run before '{late[0]}', but it runs after {done}")
        for need in contracts[name].after:
            if need in done:
                continue
            if need not in contracts:
                raise BuildError(f"'{name}' needs '{need}' to run before it, but the passes hold "
                                 f"no '{need}': {did_you_mean(need, list(contracts))}")
            shared = sorted(contracts[name].reads & contracts[need].writes)
            why = (f" (it reads {', '.join(f'ctx.{f}' for f in shared)}, which '{need}' writes)"
                   if shared else "")
            raise BuildError(f"'{name}' needs '{need}' to run before it, but it runs after "
                             f"{done}{why}")
        done.append(name)


def _text(e: BaseException) -> str:
    return str(e) if str(e) else type(e).__name__


@contextmanager
def located(where: str | Callable[[], str]) -> Iterator[None]:
    """A failure inside (TVM's, or any not an HgrtError) becomes a BuildError that says
    ``where`` (``relax_util.site``: the binding, its op and device; or a function that finds
    it, called only on failure), the failure its cause."""
    try:
        yield
    except HgrtError:
        raise
    except Exception as e:
        raise BuildError(f"{where if isinstance(where, str) else where()}: {_text(e)}") from e


def _check_ir(mod: Any, name: str) -> None:
    if not isinstance(mod, tvm.IRModule):
        return
    try:
        relax.analysis.well_formed(mod)  # TVM 0.27: raises on the first violation
    except Exception as e:
        raise BuildError(f"IR is not well formed after '{name}': {e}\n"
                         f"{mod.script()[:4000]}") from e


def run_passes(ir: Any, ctx: Any, passes: Sequence[tuple[str, Pass]],
               verify: bool | None = None) -> Any:
    """Apply ``passes`` (name, fn(ir, ctx) -> ir) in order; errors name the pass and its history.
    The order is checked first (``check_order``)."""
    check_order(passes)
    verify = os.environ.get("HGRT_VERIFY_IR", "") not in ("", "0") if verify is None else verify
    done: list[str] = []
    for name, fn in passes:
        start = time.perf_counter()
        try:
            ir = fn(ir, ctx)
            if verify:
                _check_ir(ir, name)
        except Exception as e:
            ours = isinstance(e, HgrtError)
            # the cause is the failure itself (TVM's), not the error that located it
            cause = e.__cause__ if ours and e.__cause__ is not None else e
            raise (type(e) if ours else BuildError)(
                f"'{name}' failed after {done}: {_text(e)}") from cause
        done.append(name)
        log = getattr(ctx, "log", None)
        if log is not None:
            log(f"{name}: {time.perf_counter() - start:.2f} s")
    return ir
