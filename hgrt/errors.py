"""hgrt's exceptions.

Every error hgrt raises on bad input is an ``HgrtError``; each subclass also inherits the builtin
exception it resembles, so ``except ValueError`` keeps working for code written against TVM.
"""

from __future__ import annotations


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


class ExecutionError(HgrtError, RuntimeError):
    """A kernel or copy failed while the graph was running; names the node and its device."""


class BuildError(HgrtError, RuntimeError):
    """Compilation failed: a pass broke, a GPU function was left unscheduled, an op cannot be
    placed."""


class PlanError(HgrtError, RuntimeError):
    """The memory plan is invalid (two live entries overlap, a storage spans devices)."""


class RemoteError(HgrtError, RuntimeError):
    """An RPC session failed: the server died, timed out, or refused the request."""


def did_you_mean(name: str, known: list[str] | tuple[str, ...], limit: int = 20) -> str:
    """Describe what exists when ``name`` was not found (used in 'not found' messages)."""
    known = list(known)
    shown = ", ".join(repr(k) for k in known[:limit])
    more = f" and {len(known) - limit} more" if len(known) > limit else ""
    if not known:
        return f"{name!r} not found; none exist"
    return f"{name!r} not found; known: [{shown}{more}]"
