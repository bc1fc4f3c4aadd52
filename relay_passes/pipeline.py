"""Run passes in order and say where it broke: "'insert_copies' failed after ['place_devices']";
inside a pass, ``located`` adds the binding, its op and device to a failure of TVM's:
"... binding 'lv3' (relax.nn.prelu) on cpu:1: AssertionError", TVM's exception as the cause.

With ``HGRT_VERIFY_IR=1`` (or ``verify=True``) the Relax IR is checked for well-formedness after
every pass, so a pass that produces bad IR is named instead of the pass that trips over it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import tvm
from tvm import relax

from hgrt.errors import BuildError, HgrtError

Pass = Callable[[Any, Any], Any]


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
    """Apply ``passes`` (name, fn(ir, ctx) -> ir) in order; errors name the pass and its history."""
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
