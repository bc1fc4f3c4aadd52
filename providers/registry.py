"""The kernel providers, by name: what each one is to the compiler and to the runtime, declared
once (``KernelProvider``), so that no other module needs to know which providers exist.

A provider computes some of a graph's kernels instead of TVM: at build, its claim passes turn
the ops it takes into ``R.call_dps_packed`` calls of global functions under its
``func_prefix`` (graph nodes whose ``provider`` attr names it); at run time the executor binds
those nodes to the functions its runtime module registers. TVM is the default provider:
whatever no other provider claims, compiled into the model's library.

This module is base layer (it imports only ``hgrt.errors``): the graph's validation asks it
which providers may write an output over an input. A provider's compile and runtime halves
live in its own folder and are named here by module path, imported where they are needed
(``compile_passes``, ``load_runtime``), as tinygrad finds a backend by name.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from hgrt.errors import BuildError, did_you_mean

__all__ = ["DEFAULT", "SLOTS", "KernelProvider", "forget_memory", "get", "kernel_choices",
           "names", "of_func", "of_node", "register", "registered", "unregister"]

DEFAULT = "tvm"  # the provider of every kernel no other provider claims
# where a provider's passes run in the build: "claim" after the placement and the copies
# (split_concat), before the batch norms are folded; "tail" after them, before lowering
SLOTS = ("claim", "tail")


@dataclass(frozen=True)
class KernelProvider:
    """A kernel provider, declared once in its folder's ``__init__.py``.

    To the compiler: ``passes`` — ``(slot, "module:function")`` pairs, each a pass
    (``pass(mod, ctx) -> mod`` with a ``@contract``) run at that slot of ``hgrt.compiler.PASSES``
    under its own name; ``kernels.default`` / rules / overrides choose per op between
    ``"tvm"``, ``"auto"`` and the registered names. To the runtime: ``runtime``, a module with
    ``load()`` (registers the provider's global functions; raises ``GraphError`` saying why it
    cannot), ``unavailable_reason() -> str | None`` and ``forget(ranges)`` (drop what it
    caches about memory a module frees); ``inplace``: its kernels may write output 0 over the
    input ``attrs.inplace`` names; ``any_alignment``: its kernels take buffers at any address;
    ``solo_neighbours``: the small injective TVM kernels beside its kernels run on their
    caller's thread alone (its threads spin between kernels). To the tools: ``op_attr``, the
    node attr that says what a kernel computes (the profiler's and inspect's label), ``isa_attr``
    the one naming the instruction set it packed weights for, ``weights_summary``
    (``"module:function"`` of ``(name, array)`` pairs -> a dict with ``blobs``, ``packed``,
    ``plain`` bytes, ``format_weights`` its line for ``hgrt inspect``), and ``device_note``
    (``graph, device -> str``: what ``hgrt.Host`` adds about a device's weights)."""

    name: str
    func_prefix: str
    title: str = ""
    runtime: str | None = None
    passes: tuple[tuple[str, str], ...] = ()
    serves: Callable[[Any], bool] | None = None
    inplace: bool = False
    any_alignment: bool = False
    solo_neighbours: bool = False
    op_attr: str | None = None
    isa_attr: str | None = None
    weights_summary: str | None = None
    format_weights: Callable[[dict], str] | None = None
    device_note: Callable[[Any, int], str] | None = None
    options: tuple[str, ...] = field(default=())  # the Kernels options it reads

    def owns(self, func_name: str | None) -> bool:
        """Whether ``func_name`` (a graph node's) is one of this provider's kernels."""
        return bool(func_name) and func_name.startswith(self.func_prefix)  # type: ignore[union-attr]

    def load_runtime(self) -> ModuleType | None:
        """The runtime module (imported, not loaded: call its ``load()`` to build and register
        the kernels), or None for a provider without one."""
        return None if self.runtime is None else importlib.import_module(self.runtime)

    def imported_runtime(self) -> ModuleType | None:
        """The runtime module if this process imported it already, else None (nothing of it
        to forget)."""
        return None if self.runtime is None else sys.modules.get(self.runtime)

    def compile_passes(self, slot: str) -> list[tuple[str, Any]]:
        """``(name, pass)`` of the passes this provider runs at ``slot``."""
        return [(ref.partition(":")[2], _resolve(ref)) for at, ref in self.passes if at == slot]

    def summarize_weights(self, params: Any) -> dict:
        """``weights_summary`` over ``params`` (``(name, array)`` pairs), or {}."""
        return {} if self.weights_summary is None else _resolve(self.weights_summary)(params)


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, KernelProvider] = {}


def register(provider: KernelProvider) -> KernelProvider:
    """Add ``provider`` under its name (a second provider of a name or a prefix is refused)."""
    if provider.name in (DEFAULT, "auto") or not provider.name.isidentifier():
        raise BuildError(f"kernel provider name {provider.name!r}: an identifier other than "
                         f"'tvm' and 'auto'")
    for other in _REGISTRY.values():
        if other.name == provider.name and other != provider:
            raise BuildError(f"kernel provider {provider.name!r} is already registered")
        if other.name != provider.name and (other.func_prefix.startswith(provider.func_prefix)
                                            or provider.func_prefix.startswith(other.func_prefix)):
            raise BuildError(f"kernel provider {provider.name!r}: prefix "
                             f"{provider.func_prefix!r} overlaps {other.name!r}'s")
    bad = [slot for slot, _ in provider.passes if slot not in SLOTS]
    if bad:
        raise BuildError(f"kernel provider {provider.name!r}: pass slot {bad[0]!r} is not one "
                         f"of {list(SLOTS)}")
    _REGISTRY[provider.name] = provider
    return provider


def unregister(name: str) -> None:
    """Remove the provider ``name`` (tests register providers of their own)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[KernelProvider, ...]:
    """Every registered provider, in registration order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def kernel_choices() -> tuple[str, ...]:
    """What a build's ``kernels`` may say for an op: ``auto``, ``tvm`` and each provider."""
    return ("auto", DEFAULT, *_REGISTRY)


def get(name: str) -> KernelProvider:
    """The provider ``name``; a BuildError lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise BuildError(f"kernel provider {did_you_mean(name, list(_REGISTRY))}") from None


def of_func(func_name: str | None) -> KernelProvider | None:
    """The provider whose kernel ``func_name`` is, or None (a TVM kernel or a special node)."""
    for p in _REGISTRY.values():
        if p.owns(func_name):
            return p
    return None


def of_node(attrs: dict[str, str]) -> KernelProvider | None:
    """The provider a graph node's ``provider`` attr names, or None (TVM, or one not
    registered in this process)."""
    return _REGISTRY.get(attrs.get("provider", DEFAULT))


def forget_memory(ranges: list[tuple[int, int]]) -> None:
    """Tell every provider whose runtime this process loaded that the byte ranges
    ``[begin, end)`` are freed (what it caches per weight address goes with them)."""
    for p in _REGISTRY.values():
        runtime = p.imported_runtime()
        if runtime is not None:
            runtime.forget(ranges)
