"""hgrt's kernel providers: TVM by default, and each other provider in a folder of its own
(``providers/<name>/``: its claim passes, its runtime module and native code, its weight
format), declared in that folder's ``__init__.py`` and registered here by name.

A new provider adds its folder and one line below; nothing else in hgrt names it
(docs/architecture.md, "Adding a kernel provider").
"""

from hgrt.providers import cudalibs, onednn
from hgrt.providers.registry import (
    DEFAULT,
    SLOTS,
    KernelProvider,
    forget_memory,
    get,
    kernel_choices,
    names,
    of_func,
    of_node,
    register,
    registered,
    unregister,
)

__all__ = ["DEFAULT", "SLOTS", "KernelProvider", "forget_memory", "get", "kernel_choices",
           "names", "of_func", "of_node", "register", "registered", "unregister"]

register(onednn.PROVIDER)
register(cudalibs.PROVIDER)
