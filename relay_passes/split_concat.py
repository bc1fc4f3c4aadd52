"""split_concat: a convolution of a two-part channel concat becomes the sum of two convolutions,
one per part, so the concat is never written.

A convolution with ``groups=1`` is linear in its input channels, so

    conv2d(concat([a, b], axis=1), W) == conv2d(a, W[:, :Ca]) + conv2d(b, W[:, Ca:])

and a max pool between them (per channel) goes to the parts:
``max_pool(concat([a, b])) == concat([max_pool(a), max_pool(b)])``. The concat's copy of every
element of ``a`` and ``b`` goes; the convolutions do the same multiply-adds, one more call, and
the sum is the residual add that both kernel providers fuse (oneDNN's ``sum`` post-op, written in
place where the plan lets it: ``claim_onednn``; TVM's fused elementwise tail). squeezenet's
eight fire modules are exactly this; measured there (2 threads, AVX-512, the split written into
the ONNX model and built beside the original, ``GraphModule.run`` interleaved 200x3): oneDNN
kernels 2.64-2.75 -> 2.48-2.58 ms (0.94x), TVM kernels 4.25-4.41 -> 3.92-4.07 ms (0.92x); without
moving the two max pools, 0.98x: a pool of the concat read 2x the bytes of one part's.

Taken only where it costs one extra call per concat: exactly two parts, the concat (or the max
pool of it) read by one convolution and nothing else, all on one CPU device (a GPU's concat is
cheap next to a kernel launch: not measured, not taken), static float32 NCHW shapes, the
convolution's weight known at build. The weight's halves are new weights (``<name>.split0``,
``.split1``); the original goes when nothing else reads it. Runs after insert_copies (devices
known) and before claim_onednn; the new bindings join ``ctx.placed`` (device, report rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from hgrt.relay_passes.context import BuildContext, PlacementRow
from hgrt.relay_passes.relax_util import MainReader, bindings, op_name
from hgrt.relay_passes.relax_util import float32_shape as _shape


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
            or ctx.devices[device].kind != "cpu"
            or not all(isinstance(p, relax.Var) and _shape(p) is not None for p in parts.fields)):
        return None
    reader, pool = g.only_user(b.var), None
    if reader is not None and op_name(reader.value) == "relax.nn.max_pool2d":
        if not _nchw(reader) or ctx.placed.op_device.get(reader.var.name) != device:
            return None
        reader, pool = g.only_user(reader.var), reader
    if (reader is None or op_name(reader.value) != "relax.nn.conv2d" or not _nchw(reader)
            or ctx.placed.op_device.get(reader.var.name) != device
            or _shape(reader.var) is None):
        return None
    weight = g.value(reader.value.args[1])
    if weight is None or weight.ndim != 4 or weight.dtype != np.float32 or weight.shape[1] != \
            out[1]:
        return None
    return _Split(b, pool, reader, weight, device)


class _Names:
    def __init__(self, func: relax.Function) -> None:
        self.taken = {b.var.name for b in bindings(func)} | {p.name for p in func.params}

    def __call__(self, name: str) -> str:
        while name in self.taken:
            name += "_"
        self.taken.add(name)
        return name


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
            pname = f"{wname}.split{k}"
            while pname in w.source:
                pname += "_"
            param = w.new_param(pname, half, getattr(wvar.ty, "vdevice", None), names.taken,
                                "split_concat")
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
        ctx.log(f"split_concat: {conv.var.name} = conv2d of {s.concat.var.name}'s two parts"
                + (f", through {s.pool.var.name}" if s.pool is not None else ""))
    blocks = []
    for block in func.body.blocks:
        kept = []
        for b in block.bindings:
            if b.var in gone:
                continue
            kept.extend(replaced.get(b.var, [b]))
        blocks.append(type(block)(kept))
    body = relax.SeqExpr(blocks, func.body.body)
    used = set(relax.analysis.free_vars(body))
    n_in = int(func.attrs["num_input"])
    params = list(func.params[:n_in])
    for p in func.params[n_in:]:
        if p in used or p not in old_weights:
            params.append(p)
        else:  # read only by the split convolutions: gone
            w.source.pop(w.graph_names.pop(p.name, p.name), None)
    new = mod.clone()
    new.update_func(new.get_global_var("main"), relax.Function(
        params + new_params, body, func.ret_ty, func.is_pure, func.attrs))
    return new
