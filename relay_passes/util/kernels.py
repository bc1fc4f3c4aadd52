"""Who computes each op of a build: TVM, ``"auto"`` or a registered kernel provider, said per
op like a device (``Kernels``: a provider for the whole build, rules by op, overrides by node,
and the providers' options). Each provider's claim passes read it; ``hgrt.build(kernels=)`` and
``hgrt compile --kernels`` take it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hgrt.errors import BuildError
from hgrt.providers import kernel_choices
from hgrt.relay_passes.util.relax_util import match_op_rule

__all__ = ["WINOGRAD_SHARE", "Kernels"]

# by default Winograd's larger weights (4x a convolution's) may add at most this share of the
# model's weight bytes: the convolutions with the most output tiles first, as they save the
# most time per byte. Over the zoo this keeps the default build's planned bytes within 1.10x
# of a build on TVM's kernels (the direct oneDNN build plans 0.77-1.10x of it);
# ``Kernels(winograd=True)`` takes every convolution where Winograd is faster.
WINOGRAD_SHARE = 0.10


@dataclass
class Kernels:
    """Who computes each kernel of a build, chosen per op like a device:
    an ``overrides`` entry for the node (the binding name of its conv2d or matmul, as
    ``BuildResult.print_placement()`` lists it), else the first of ``rules`` whose op pattern
    matches (as ``Placement`` rules: ``"nn.conv2d"``, ``"matmul"``, ``"nn.*"``), else
    ``default``; each one of ``providers.kernel_choices()`` (``"auto"``, ``"tvm"`` and the
    registered providers). ``hgrt.build(kernels="onednn")`` is ``Kernels("onednn")``.
    ``winograd`` (an option of the providers that offer Winograd, oneDNN's): 3x3 convolutions
    between NHWC tensors run as Winograd F(4x4, 3x3) where that measured faster (the provider's
    rule), and their weights then take 4x the bytes (36 numbers per filter instead of 9). A number
    (default ``WINOGRAD_SHARE``, 0.10) bounds the bytes Winograd adds by that share of the model's
    weights, the convolutions with the most output tiles first; ``True`` takes every one where it is
    faster, ``False`` none. The build log says what the choice costs.

    >>> Kernels("onednn", rules={"matmul": "tvm"}, overrides={"lv12": "tvm"})  # doctest: +SKIP
    """

    default: str = "auto"
    rules: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    winograd: bool | float = WINOGRAD_SHARE

    @classmethod
    def of(cls, value: Any) -> Kernels:
        """``value`` (a provider name or a ``Kernels``) as a checked ``Kernels``."""
        kernels = value if isinstance(value, cls) else cls(value) if isinstance(value, str) \
            else None
        if kernels is None:
            raise BuildError(f"kernels={value!r}: a provider ({list(kernel_choices())}) or "
                             f"hgrt.Kernels")
        for what, table in (("rules", kernels.rules), ("overrides", kernels.overrides)):
            if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
                raise BuildError(f"Kernels {what}={table!r}: a dict from "
                                 f"{'op pattern' if what == 'rules' else 'node name'} to provider")
        w = kernels.winograd
        if not isinstance(w, bool) and not (isinstance(w, int | float) and w >= 0):
            raise BuildError(f"Kernels winograd={w!r}: True (wherever it is faster), False "
                             f"(never) or the share of the model's weight bytes it may add "
                             f"(a number >= 0; default {WINOGRAD_SHARE})")
        for where, provider in kernels.choices():
            if provider not in kernel_choices():
                raise BuildError(f"{where}={provider!r}: choose one of {list(kernel_choices())}")
        return kernels

    def choices(self) -> list[tuple[str, str]]:
        """(where it was said, provider) for the default, each rule and each override."""
        return [("kernels", self.default),
                *((f"kernels rule {k!r}", v) for k, v in self.rules.items()),
                *((f"kernels override {k!r}", v) for k, v in self.overrides.items())]

    def choice(self, node: str, op: str) -> tuple[str, bool]:
        """The provider of ``node`` (a binding of ``op``) and whether an override named it."""
        if node in self.overrides:
            return self.overrides[node], True
        rule = match_op_rule(op, self.rules)
        return (self.default if rule is None else self.rules[rule]), False

    def said(self, node: str, op: str) -> str:
        """Where the provider of ``node`` was asked, as a reason says it:
        ``kernels='tvm'``, ``kernels rule 'matmul'='tvm'``, ``kernels override 'lv3'='tvm'``."""
        if node in self.overrides:
            return f"kernels override {node!r}={self.overrides[node]!r}"
        rule = match_op_rule(op, self.rules)
        return f"kernels={self.default!r}" if rule is None else \
            f"kernels rule {rule!r}={self.rules[rule]!r}"
