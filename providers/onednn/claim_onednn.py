"""claim_onednn: hand convolutions and dense layers on x86-64 CPUs to oneDNN kernels.

The kernel provider is chosen per op at build, like a device (``hgrt.build(..., kernels=)``: a
provider for the whole build, or ``Kernels`` with rules by op and overrides by node): ``"tvm"``
leaves the op to TVM; ``"onednn"`` claims it, and is a ``BuildError`` where oneDNN cannot run
or, for a node named by an override, cannot compute it; ``"auto"`` claims where it can and
otherwise says once why not (``onednn_policy``). A chain (``onednn_chains``)

    conv2d(x, W)  [+ per-channel weight | batch_norm]*  [post-op]*  [max_pool]
    matmul(x, W)  [+ bias]  [post-op]*

(a post-op: a residual add, an activation, or a quantize-dequantize of one scale and zero point)
on a CPU device, W a weight, each intermediate read once (the max pool only after a convolution
of the model's input: a stem, run in oneDNN's blocked layout), becomes one
``R.call_dps_packed("hgrt.onednn.conv2d", (x, packed[, residual]), out)`` bound to the chain's
last variable. ``packed`` is a new weight (a uint8 blob, ``onednn_blob``): a header
(``HEADER_SLOTS``), W with batch norms folded in, packed once in the layout oneDNN picks on this
machine, then the bias. The residual add, the activation and the grid of a quantize-dequantize
are oneDNN post-ops (a binary add that reads an NHWC residual in place, else ``sum``;
``eltwise``); the node offers the output
the residual's bytes (``attrs.inplace``), and where the memory plan takes the offer the kernel
adds with ``sum`` into them, reading the residual once. Per-channel multiplies and adds (batch
norms, scale layers) are folded into W and the bias. Weights the chains read are dropped when
nothing else reads them. Activations stay NHWC between oneDNN kernels and through the TVM ops
between them where ``channels_last`` says so; a reorder node turns them back to NCHW before any
other reader. The ExternFunc's attrs become graph node attrs (``provider``, ``onednn_op``,
``onednn_isa``, ``onednn_impl``, ``onednn_layouts``, ``flops``, ``inplace``), and the placement
report's rows of claimed ops say ``kernels: onednn``. Layer norms, softmaxes and matmuls of
two activations (``rows``) that ``auto_choice`` gives oneDNN become calls of its row kernels;
convolutions and dense layers whose input is a QDQ grid and whose weights an int8 one compute
in int8 where the host has VNNI (``int8``).

Reads ``ctx.options.kernels``, the provider's runtime module (``kernels``:
``unavailable_reason()``, ``pack()``, ``isa()``, ``implementation()``, ``layout_name()``),
``ctx.placed``, ``ctx.placement`` (budgets) and ``ctx.weights``; writes new weights to
``ctx.weights`` and the report's ``kernels`` column to ``ctx.placed``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm
from tvm import relax

from hgrt.providers.onednn import PROVIDER, blocked_layout, channels_last, reasons
from hgrt.providers.onednn.auto_choice import keep_what_pays
from hgrt.providers.onednn.blob import (
    ALGO,
    SLOT,
    winograd_growth,
)
from hgrt.providers.onednn.chains import (
    Chain,
    ChainGraph,
    check_choices,
    find_chains,
    header,
)
from hgrt.providers.onednn.int8 import VNNI_ISAS, int8_able, quantize_chains
from hgrt.providers.onednn.policy import (
    AUTO_MIN_MACS,
    choose_winograd,
    log_winograd,
    onednn_runtime,
    weight_room,
)
from hgrt.providers.onednn.rows import FINDERS as ROW_FINDERS
from hgrt.providers.onednn.rows import FUNC_NAME as ROW_FUNC
from hgrt.providers.onednn.rows import RowOp, find_rows
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import bindings

ONEDNN_PREFIX = PROVIDER.func_prefix  # what its kernels' graph nodes call

__all__ = ["FUNC_NAME", "claim_onednn"]

FUNC_NAME = {kind: ONEDNN_PREFIX + kind for kind in ("conv2d", "dense")}


def _new_weight(g: ChainGraph, pname: str, value: np.ndarray, vdevice: Any, taken: set[str],
                takes_over: bool) -> relax.Var:
    """A new weight holding ``value``, recorded in ``ctx.weights``. It takes the graph name
    ``pname`` of the weight it replaces when ``takes_over`` (so ``set_input``/``load_params``
    of that name meet a parameter of another shape, not an unknown name), else ``pname`` +
    ``.onednn``."""
    w = g.ctx.weights
    if not (takes_over and pname in w.source):  # a name of its own
        pname = w.free_name(pname + ".onednn")
    return w.new_param(pname, value, vdevice, taken, "oneDNN")


def _blob_param(chain: Chain, blob: np.ndarray, g: ChainGraph, taken: set[str]) -> relax.Var:
    """The weight holding ``chain``'s packed blob, named after the first weight it read."""
    first = chain.read[0]
    members = set(chain.members)
    pname = g.weights.get(first, chain.end.name) if isinstance(first, relax.Var) \
        else chain.end.name
    only_here = all(u is not None and u.var in members for u in g.users.get(first, [None]))
    vdevice = getattr(first.ty, "vdevice", None) or chain.x.ty.vdevice
    return _new_weight(g, pname, blob, vdevice, taken, only_here)


class _Emitter:
    """Packs the chains in dataflow order and makes their calls. Tensors the plan keeps NHWC
    (``channels_last``) are read and written so: the kernel's result is a new variable of
    shape N, H, W, C. ``room``: weight bytes a budgeted device may still take (``weight_room``);
    a Winograd convolution whose larger weights would not fit stays direct."""

    def __init__(self, g: ChainGraph, chains: list[Chain], runtime: Any, winograd: bool | float,
                 room: dict[int, int] | None = None) -> None:
        self.g, self.runtime = g, runtime
        self.winograd_bytes: list[int] = []  # per Winograd convolution: the weights' growth
        self.room = dict(room or {})
        self.over_budget: dict[int, int] = {}  # device -> convolutions kept direct for it
        self.taken = {p.name for p in g.func.params}
        convs = [c for c in chains if c.kind == "conv2d"]
        readers = {c.root.var for c in convs} | {c.residual_at for c in convs
                                                 if c.residual_at is not None}
        self.plan = channels_last.Plan(g, {c.end for c in convs}, readers, self._weight)
        self.nhwc = runtime.nhwc_tag()
        self.block, self.block_tag = runtime.blocked_tag()
        self.blocked = blocked_layout.blocked(self.plan, g, chains) if self.block_tag else set()
        self.isa = runtime.isa()
        self.calls: dict[relax.Var, tuple[relax.Var, relax.Call]] = {}
        self.blobs: list[relax.Var] = []
        self.plain_bytes = sum(v.nbytes for p in g.func.params[int(g.func.attrs["num_input"]):]
                               if (v := g.value(p)) is not None)
        self.winograd, self.winograd_candidates = choose_winograd(
            [(c, self.header(c)) for c in convs], self.nhwc, winograd, self.plain_bytes)

    def header(self, chain: Chain) -> np.ndarray:
        """``chain``'s blob header with the layouts of its activations."""
        h = header(chain)
        for slot, v in (("src_tag", chain.x), ("res_tag", chain.residual), ("dst_tag", chain.end)):
            h[SLOT[slot]] = self._tag(v)
        return h

    def _weight(self, name: str, value: np.ndarray, vdevice: Any) -> relax.Var:
        var = _new_weight(self.g, name, value, vdevice, self.taken, False)
        self.blobs.append(var)
        return var

    def _fits(self, chain: Chain, growth: int) -> bool:
        """Whether ``growth`` more bytes of weights fit the budget of ``chain``'s device (taken
        from its room if so; a device without a budget always has room)."""
        dev = self.g.ctx.device_of_vdevice(getattr(chain.x.ty, "vdevice", None))
        if dev not in self.room:
            return True
        if growth > self.room[dev]:
            self.over_budget[dev] = self.over_budget.get(dev, 0) + 1
            return False
        self.room[dev] -= growth
        return True

    def _tag(self, v: relax.Var | None) -> int:
        if v in self.blocked:
            return self.block_tag
        return self.nhwc if v in self.plan.nhwc else 0

    def emit(self, chain: Chain) -> None:
        h = self.header(chain)
        growth = winograd_growth(h)
        winograd = id(chain) in self.winograd and self._fits(chain, growth)
        h[SLOT["algo"]] = ALGO["winograd"] if winograd else ALGO["direct"]
        if winograd:
            self.winograd_bytes.append(growth)
        blob = self.runtime.pack(h, chain.weight, chain.tail())
        param = _blob_param(chain, blob, self.g, self.taken)
        self.blobs.append(param)
        layouts = [self.runtime.layout_name(self._tag(v))
                   for v in (chain.x, chain.end, chain.residual) if v is not None]
        label = [("conv2d(winograd)" if winograd and op == "conv2d" else op)
                 for op in chain.label]
        attrs = {"provider": "onednn", "onednn_op": "+".join(label),
                 "onednn_isa": self.isa, "onednn_impl": self.runtime.implementation(blob),
                 "onednn_layouts": ", ".join(layouts),  # input, output[, residual]
                 "flops": str(2 * chain.macs)}  # the profiler's GFLOP/s: no weight shape here
        if chain.residual is not None and self._tag(chain.residual) == self._tag(chain.end):
            # the output (of the residual's shape, and never pooled: _add, _max_pool) may take
            # the residual's bytes where the residual dies here: oneDNN's sum post-op then adds
            # into it in place (no separate read of the residual)
            attrs["inplace"] = "2"
        func = relax.ExternFunc(FUNC_NAME[chain.kind])
        for key, value in attrs.items():
            func = func.with_attr(key, value)
        args = [v for v in (chain.x, param, chain.residual) if v is not None]
        end = chain.end
        ty = blocked_layout.blocked_type(end, self.block) if end in self.blocked else \
            channels_last.nhwc_type(end) if end in self.plan.nhwc else None
        var = end if ty is None else type(end)(end.name, ty)
        self.calls[end] = (var, relax.op.call_dps_packed(func, relax.Tuple(args), var.ty))

    def emit_row(self, op: RowOp) -> bool:
        """The call of row op ``op``, unless an activation it reads is NHWC here (then it
        stays TVM's: the row kernels read plain tensors). Whether it made one."""
        if any(a in self.plan.nhwc for a in op.args):
            return False
        args = list(op.args)
        if op.params is not None:
            first = op.read[0] if op.read else None
            name = self.g.weights.get(first, op.end.name) if first is not None else op.end.name
            args.append(self._weight(f"{name}.{op.kind}", op.params, op.args[0].ty.vdevice))
        func = relax.ExternFunc(ROW_FUNC[op.kind])
        attrs = {"provider": "onednn", "onednn_op": "+".join(op.label),
                 "onednn_isa": self.isa}
        if op.macs:
            attrs["flops"] = str(2 * op.macs)
        for key, value in attrs.items():
            func = func.with_attr(key, value)
        self.calls[op.end] = (op.end, relax.op.call_dps_packed(func, relax.Tuple(args),
                                                               op.end.ty))
        return True


def _rewrite(func: relax.Function, emitter: _Emitter, drop: set[relax.Var],
             ctx: BuildContext) -> relax.Function:
    """``func`` with each chain's last binding bound to its call, the rest of it dropped, the
    NHWC forms of the plan, the new weights appended to the params and the weights nothing
    reads any more removed."""
    taken = {b.var.name for b in bindings(func)} | emitter.taken
    rewriter = channels_last.Rewriter(emitter.plan, emitter.calls, taken)
    blocks = [rewriter.block(block, drop) for block in func.body.blocks]
    ctx.placed.say_why(rewriter.onednn_ops, channels_last.NHWC_WHY, PROVIDER.name)
    body = relax.SeqExpr(blocks, func.body.body)
    used = set(relax.analysis.free_vars(body))
    n_in = int(func.attrs["num_input"])
    params = list(func.params[:n_in])
    w = ctx.weights
    new_names = {w.graph_names[b.name] for b in emitter.blobs}
    for p in func.params[n_in:]:
        if p in used:
            params.append(p)
            continue
        pname = w.graph_names.pop(p.name, p.name)  # read only by claimed chains: gone
        if pname not in new_names:  # (else a new weight took over its name)
            w.source.pop(pname, None)
    return relax.Function(params + emitter.blobs, body, func.ret_ty, func.is_pure, func.attrs)


# after insert_copies: devices known, weights per device; after split_concat: its halves claimed
@contract(reads={"devices", "options", "placed", "placement", "weights"},
          writes={"placed", "weights"}, after=("insert_copies", "split_concat"),
          before=("fold_batch_norm",))
def claim_onednn(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Claim what oneDNN computes (see module doc); ``mod`` untouched when nothing is claimed."""
    kernels = Kernels.of(ctx.options.kernels)
    func = mod["main"]
    check_choices(func, kernels, frozenset(ROW_FINDERS))
    runtime = onednn_runtime(ctx, kernels)
    if runtime is None or "num_input" not in (func.attrs or {}):
        reasons.unavailable(ctx, func, kernels)  # (the report's why, where "auto" was asked)
        return mod
    g = ChainGraph(func, ctx)
    chains = find_chains(g, kernels)
    rows = find_rows(g, kernels)
    for r in rows:  # a matmul of two activations: not a chain's, a row kernel's
        g.declined.pop(r.root.var.name, None)
    reasons.declined(ctx, g.declined)
    auto = [c for c in [*chains, *rows] if c.choice == "auto"]
    # the model's, whoever asked: auto's choice is per model
    macs = sum(c.macs for c in [*chains, *rows])
    if auto and macs < AUTO_MIN_MACS:
        ctx.log(f"kernels: tvm for {len(auto)} ops (auto: the {len(chains) + len(rows)} ops "
                f"oneDNN could take "
                f"are {macs} multiply-adds, below {AUTO_MIN_MACS}: its per-call cost would "
                f"outweigh them)")
        reasons.below_floor(ctx, auto, macs, AUTO_MIN_MACS)
        g = ChainGraph(func, ctx)
        chains = find_chains(g, kernels, frozenset({"onednn"}))
        rows = [r for r in rows if r.choice == "onednn"]
    elif auto:  # per op: what oneDNN saves against the switches between thread pools
        if runtime.isa() in VNNI_ISAS:
            for c in chains:
                c.int8_able = int8_able(g, c)
        g, chains, rows = keep_what_pays(func, ctx, kernels, g, chains, rows)
    if not chains and not rows:
        return mod
    int8 = quantize_chains(g, chains, runtime.isa())
    emitter = _Emitter(g, chains, runtime, kernels.winograd, weight_room(g))
    position = {b.var: i for i, b in enumerate(bindings(func))}
    for chain in sorted(chains, key=lambda c: position[c.end]):  # producers first
        emitter.emit(chain)
    rows = [r for r in rows if emitter.emit_row(r)]
    drop = {v for c in [*chains, *rows] for v in c.members[:-1]}
    reasons.claimed(ctx, [*chains, *rows], kernels, macs, AUTO_MIN_MACS)  # the report's why
    ctx.log(f"oneDNN ({emitter.isa}) claims {len(chains)} ops ({int8} in int8) and "
            f"{len(rows)} layer norms, softmaxes and matmuls of two activations, "
            f"{len(emitter.plan.nhwc)} "
            f"tensors NHWC: " + ", ".join(sorted({"+".join(c.label) for c in chains})))
    log_winograd(ctx, emitter.winograd_candidates, emitter.winograd_bytes, emitter.plain_bytes,
                 kernels.winograd)
    for dev, n in emitter.over_budget.items():
        ctx.log(f"oneDNN: {n} 3x3 convolutions on {ctx.devices[dev].name} kept direct: as "
                f"Winograd their weights would not fit its placement budget")
    new = mod.clone()
    new.update_func(new.get_global_var("main"), _rewrite(func, emitter, drop, ctx))
    return new
