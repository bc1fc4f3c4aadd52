"""split_concat: a convolution of a two-part channel concat becomes the sum of two convolutions,
one per part, so the concat is never written.

A convolution with ``groups=1`` is linear in its input channels, so

    conv2d(concat([a, b], axis=1), W) == conv2d(a, W[:, :Ca]) + conv2d(b, W[:, Ca:])

and a max pool between them (per channel) goes to the parts:
``max_pool(concat([a, b])) == concat([max_pool(a), max_pool(b)])``. The concat's copy of every
element of ``a`` and ``b`` goes; the convolutions do the same multiply-adds, one more call, and
the sum is the residual add that both kernel providers fuse (oneDNN's ``sum`` post-op, written in
place where the plan lets it: ``claim_onednn``; TVM's fused elementwise tail). Seven of
squeezenet's eight fire modules are this (the eighth's concat, read by the classifier, is not);
measured there (2 threads, AVX-512, one build with the pass and one without, ``run()``
interleaved 3 x 200 times in one process): oneDNN kernels 2.64-2.69 -> 2.45-2.50 ms (0.93x),
TVM kernels 3.99-4.08 -> 3.77-3.89 ms (0.94-0.95x); the same split written into the ONNX model
but with the two max pools left on the concat gained only 0.98x.

Taken only where it costs one extra call per concat and less traffic than the concat: exactly
two parts, the concat (or the max pool of it) read by one convolution and nothing else, whose
result is smaller than the concat (the sum writes and reads a partial result as large: a
squeeze convolution's 16-64 channels from 128-512, yes; squeezenet's classifier, 1000 from
512, no: 1.5 % slower whole runs with TVM kernels, 0.8 % with oneDNN's), all on one CPU device
(a GPU's concat is cheap next to a kernel launch: not measured, not taken), static float32 NCHW
shapes, the convolution's weight known at build, no per-channel scale after it (a batch norm or
a multiply, which oneDNN folds into one convolution's weights, not into a sum's). The weight's
halves are new weights (``<name>.split0``, ``.split1``); the original goes when nothing else
reads it. The new bindings join ``ctx.placed`` (device, report rows), the concat's and the
pool's leave it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from hgrt.devices import is_cpu
from hgrt.relay_passes.util.context import BuildContext, PlacementRow
from hgrt.relay_passes.util.pipeline import contract
from hgrt.relay_passes.util.relax_util import MainReader, bindings, op_name
from hgrt.relay_passes.util.relax_util import float32_shape as _shape


@dataclass
class _Split:
    concat: relax.VarBinding
    pool: relax.VarBinding | None
    conv: relax.VarBinding
    weight: np.ndarray
    device: int


def _nchw(b: relax.VarBinding) -> bool:
    a = b.value.attrs
    if op_name(b.value) == "relax.nn.conv2d":
        return (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)) \
            == ("NCHW", "OIHW", "NCHW") and int(a.groups) == 1 \
            and str(a.out_dtype) in ("", "None", "void", "float32")
    return str(a.layout) == "NCHW" and str(a.out_layout or "NCHW") == "NCHW"


def _match(g: MainReader, b: relax.VarBinding, ctx: BuildContext) -> _Split | None:
    """The split of the concat ``b``, or None where it is not taken (see module doc)."""
    parts = b.value.args[0]
    out = _shape(b.var)
    device = ctx.placed.op_device.get(b.var.name)
    if (not isinstance(parts, relax.Tuple) or len(parts.fields) != 2 or out is None
            or len(out) != 4 or int(b.value.attrs.axis) % 4 != 1 or device is None
            or not is_cpu(ctx.devices[device])
            or not all(isinstance(p, relax.Var) and _shape(p) is not None for p in parts.fields)):
        return None
    reader, pool = g.only_user(b.var), None
    if reader is not None and op_name(reader.value) == "relax.nn.max_pool2d":
        if not _nchw(reader) or ctx.placed.op_device.get(reader.var.name) != device:
            return None
        reader, pool = g.only_user(reader.var), reader
    conv_out = None if reader is None else _shape(reader.var)
    if (reader is None or op_name(reader.value) != "relax.nn.conv2d" or not _nchw(reader)
            or ctx.placed.op_device.get(reader.var.name) != device or conv_out is None
            or int(np.prod(conv_out)) >= int(np.prod(out))):
        return None
    weight = g.value(reader.value.args[1])
    if weight is None or weight.ndim != 4 or weight.dtype != np.float32 or weight.shape[1] != \
            out[1] or _scaled_after(g, reader.var):
        return None
    return _Split(b, pool, reader, weight, device)


def _scaled_after(g: MainReader, var: relax.Var) -> bool:
    """Whether a per-channel scale (a batch norm, a multiply) follows the convolution ``var``,
    past bias adds: oneDNN folds it into the weights of one convolution, not after the sum of
    two (``claim_onednn``), so splitting would cost a kernel of its own."""
    while (user := g.only_user(var)) is not None:
        op = op_name(user.value)
        if op in ("relax.nn.batch_norm", "relax.multiply"):
            return True
        if op != "relax.add" or not any(g.value(a) is not None for a in user.value.args):
            return False
        var = user.var
    return False


class _Names:
    def __init__(self, func: relax.Function) -> None:
        self.taken = {b.var.name for b in bindings(func)} | {p.name for p in func.params}

    def __call__(self, name: str) -> str:
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name


@contract(reads={"devices", "placed", "weights"}, writes={"placed", "weights"},
          after=("insert_copies",))  # devices known, weights per device
def split_concat(mod: tvm.IRModule, ctx: BuildContext) -> tvm.IRModule:
    """Split ``main``'s convolutions of two-part concats (see module doc); ``mod`` untouched
    if there are none."""
    func = mod["main"]
    if "num_input" not in (func.attrs or {}):
        return mod
    g = MainReader(func, ctx)
    splits = [s for b in bindings(func) if op_name(b.value) == "relax.concat"
              if (s := _match(g, b, ctx)) is not None]
    if not splits:
        return mod
    names, w = _Names(func), ctx.weights
    rows = {r.node: r for r in ctx.placed.report}
    bb = relax.BlockBuilder()
    gone = {v for s in splits for v in (s.concat.var, s.pool.var if s.pool else None)}
    new_params: list[relax.Var] = []
    replaced: dict[relax.Var, list[relax.VarBinding]] = {}
    old_weights: set[relax.Var] = set()

    def bind(like: relax.Var, suffix: str, expr: relax.Expr, why: str) -> relax.Var:
        var = type(like)(names(f"{like.name}_{suffix}"), bb.normalize(expr).ty)
        ctx.placed.op_device[var.name] = ctx.placed.op_device[like.name]
        row = rows.get(like.name)
        if row is not None:
            ctx.placed.report.append(PlacementRow(var.name, row.op, row.device,
                                                  f"{row.reason}; {why}"))
        return var

    for s in splits:
        conv = s.conv
        wvar = conv.value.args[1]
        old_weights.add(wvar)
        wname = g.weights.get(wvar, wvar.name if isinstance(wvar, relax.Var) else "weight")
        cut = _shape(s.concat.value.args[0].fields[0])[1]
        why = f"split over the parts of {s.concat.var.name} (split_concat)"
        out: list[relax.VarBinding] = []
        summands = []
        for k, part in enumerate(s.concat.value.args[0].fields):
            if s.pool is not None:
                expr = relax.Call(s.pool.value.op, [part], s.pool.value.attrs)
                pooled = bind(s.pool.var, f"part{k}", expr, why)
                out.append(relax.VarBinding(pooled, bb.normalize(expr)))
                part = pooled
            half = np.ascontiguousarray(s.weight[:, :cut] if k == 0 else s.weight[:, cut:])
            pname = w.free_name(f"{wname}.split{k}")
            # the weight's device; an inline constant has none: the part's
            vdevice = getattr(wvar.ty, "vdevice", None) or part.ty.vdevice
            param = w.new_param(pname, half, vdevice, names.taken, "split_concat")
            new_params.append(param)
            expr = relax.Call(conv.value.op, [part, param], conv.value.attrs)
            var = bind(conv.var, f"part{k}", expr, why)
            out.append(relax.VarBinding(var, bb.normalize(expr)))
            summands.append(var)
        # part 0's convolution is bound first: claim_onednn grows its chain through the add
        # (part 1's result its residual) and on through the bias and activation that follow
        out.append(relax.VarBinding(conv.var, bb.normalize(relax.op.add(summands[0],
                                                                        summands[1]))))
        replaced[conv.var] = out
        row = rows.get(conv.var.name)
        if row is not None:  # the convolution's variable is the sum now
            row.op, row.reason = "relax.add", f"{row.reason}; {why}"
        ctx.log(f"split_concat: {conv.var.name} = conv2d of {s.concat.var.name}'s two parts"
                + (f", through {s.pool.var.name}" if s.pool is not None else ""))
    ctx.placed.report[:] = [r for r in ctx.placed.report
                            if r.node not in {v.name for v in gone if v is not None}]
    for v in gone:
        if v is not None:
            ctx.placed.op_device.pop(v.name, None)
    body = _replaced(func, gone, replaced)
    params = w.kept_params(func, body, old_weights)  # those only the split ones read: gone
    new = mod.clone()
    new.update_func(new.get_global_var("main"), relax.Function(
        params + new_params, body, func.ret_ty, func.is_pure, func.attrs))
    return new


def _replaced(func: relax.Function, gone: set[relax.Var | None],
              replaced: dict[relax.Var, list[relax.VarBinding]]) -> relax.SeqExpr:
    """``func``'s body without the bindings of ``gone``, each of ``replaced`` by its list."""
    blocks = []
    for block in func.body.blocks:
        kept = []
        for b in block.bindings:
            if b.var in gone:
                continue
            kept.extend(replaced.get(b.var, [b]))
        blocks.append(type(block)(kept))
    return relax.SeqExpr(blocks, func.body.body)
