"""Why oneDNN computes an op or leaves it to TVM, in the words of the placement report's
``kernels_why`` (``"<kind>: <detail>"``): what ``claim_onednn`` records for the convolutions and
matmuls it could take, and what the graph's ``provider_why`` attr then says.
"""

from __future__ import annotations

from tvm import relax

from hgrt.providers.onednn import PROVIDER
from hgrt.providers.onednn import kernels as runtime
from hgrt.providers.onednn.chains import ROOTS, Chain
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.relax_util import bindings, op_name

__all__ = ["below_floor", "claimed", "count", "declined", "switches_cost_more",
           "unavailable", "what"]


def count(n: float) -> str:
    """147k, 2.4M, 1.2G: a number of multiply-adds in a reason."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 10 * size else f"{n / size:.0f}{unit}"
    return str(int(n))


def what(chain: Chain) -> str:
    """``conv2d+relu 3x3 64->64, 2.4M MACs`` / ``dense+bias 768->3072, 1.2G MACs``."""
    w = chain.weight
    if chain.kind == "conv2d":
        groups = int(chain.root.value.attrs.groups)
        shape = f"{w.shape[2]}x{w.shape[3]} {w.shape[1] * groups}->{w.shape[0]}" + (
            f" in {groups} groups" if groups > 1 else "")
    else:
        shape = f"{w.shape[1]}->{w.shape[0]}"
    return f"{'+'.join(chain.label)} {shape}, {count(chain.macs)} MACs"


def claimed(ctx: BuildContext, chains: list, kernels: Kernels, macs: int, floor: int) -> None:
    """The rows of every op of ``chains`` (chains, and the row ops of ``rows.RowOp``: layer
    norms, softmaxes, matmuls of two activations) say oneDNN computes it, and why."""
    for c in chains:
        if isinstance(c, Chain):
            detail = what(c)
            auto = f"auto: {detail} (model {count(macs)} >= floor {count(floor)})"
        else:
            detail = "+".join(c.label) + (f", {count(c.macs)} MACs" if c.macs else "")
            auto = f"auto: {detail} among oneDNN kernels (no switch between thread pools)"
        why = auto if c.choice == "auto" else \
            f"asked: {kernels.said(c.root.var.name, op_name(c.root.value))}; {detail}"
        ctx.placed.say_why({v.name for v in c.members}, why, PROVIDER.name)
        # (a batch norm's item, the call's binding, has no row: the root's speaks for it)
        ctx.placed.row_of.update({v.name: c.root.var.name for v in c.members})


def below_floor(ctx: BuildContext, chains: list[Chain], macs: int, floor: int) -> None:
    """``chains`` (auto's) stay TVM's: the model's ops oneDNN could take are too few MACs."""
    why = (f"size floor: the model's {len(chains)} ops oneDNN could take are {count(macs)} MACs "
           f"< {count(floor)} (auto)")
    ctx.placed.say_why({c.root.var.name for c in chains}, why)


def switches_cost_more(ctx: BuildContext, chains: list[Chain],
                       modelled: dict[int, dict[str, float]], switch_us: float) -> None:
    """``chains`` (auto's) stay TVM's: what oneDNN would save on them (``modelled``: chain id
    -> us per provider) pays for no switch between thread pools (``auto_choice``)."""
    for c in chains:
        us = modelled[id(c)]
        ctx.placed.say_why({c.root.var.name}, (
            f"TVM faster: {what(c)}: {us['onednn']:.0f} us on oneDNN, {us['tvm']:.0f} us on "
            f"TVM, a switch between thread pools {switch_us:.0f} us (auto)"))


def declined(ctx: BuildContext, reasons: dict[str, str]) -> None:
    """Ops oneDNN was asked for and cannot compute (binding name -> why not)."""
    for name, why in reasons.items():
        ctx.placed.say_why({name}, f"oneDNN cannot: {why}")


def unavailable(ctx: BuildContext, func: relax.Function, kernels: Kernels) -> None:
    """Where oneDNN cannot run in this build, the ops "auto" would offer it on a CPU stay
    TVM's, and their rows say why."""
    if not any(p == "auto" for _, p in kernels.choices()):
        return
    reason = runtime.unavailable_reason()
    if reason is None and not any(PROVIDER.serves(d) for d in ctx.devices):
        reason = "no device of this build is an x86-64 CPU"
    if reason is None:
        return
    for b in bindings(func):
        op = op_name(b.value)
        device = ctx.placed.op_device.get(b.var.name)
        if op in ROOTS and kernels.choice(b.var.name, op)[0] == "auto" and device is not None \
                and not ctx.devices[device].is_gpu:
            ctx.placed.say_why({b.var.name}, f"oneDNN unavailable: {reason}")
