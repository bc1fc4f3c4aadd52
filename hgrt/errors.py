"""hgrt's exceptions.

Every error hgrt raises on bad input is an ``HgrtError``; each subclass also inherits the builtin
exception it resembles, so ``except ValueError`` keeps working for code written against TVM.
"""

from __future__ import annotations

import difflib


class HgrtError(Exception):
    """Base class of every error hgrt raises on purpose."""


class GraphError(HgrtError, ValueError):
    """A graph JSON is malformed, or does not fit the devices / library it is used with."""


class InputError(HgrtError, ValueError):
    """A value given to ``set_input`` / ``get_input`` / ``get_output`` is wrong (name, shape,
    dtype)."""


class ParamError(HgrtError, ValueError):
    """A params blob or dict does not match the graph's parameters."""


class DeviceError(HgrtError, ValueError):
    """A device list is unusable (mixed sessions, unknown device name, missing device)."""


class ProvisionError(DeviceError):
    """A model cannot be added to a ``hgrt.Host``: its name is taken, or a logical device of it
    fits no physical device's memory budget."""


class ExecutionError(HgrtError, RuntimeError):
    """A kernel or copy failed while the graph was running; names the node and its device."""


class BuildError(HgrtError, RuntimeError):
    """Compilation failed: a pass broke, a GPU function was left unscheduled, an op cannot be
    placed."""


class PlanError(HgrtError, RuntimeError):
    """The memory plan is invalid (two live entries overlap, a storage spans devices)."""


class ClosedError(HgrtError, RuntimeError):
    """The module was closed (``m.close()``, or the end of ``with hgrt.load(...) as m:``)."""


class RemoteError(HgrtError, RuntimeError):
    """An RPC session failed: the server died, timed out, or refused the request."""


def did_you_mean(name: str, known: list[str] | tuple[str, ...], limit: int = 20) -> str:
    """Say what exists when ``name`` was not found, closest matches first (for 'not found'
    messages): ``'wieght' not found; did you mean 'weight'? known: [...]``."""
    known = [str(k) for k in known]
    if not known:
        return f"{name!r} not found; none exist"
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f" did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    shown = ", ".join(repr(k) for k in known[:limit])
    more = f" and {len(known) - limit} more" if len(known) > limit else ""
    return f"{name!r} not found;{hint} known: [{shown}{more}]"
