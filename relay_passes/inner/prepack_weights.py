"""prepack_weights: weights stored in the layout their kernel reads, once, at build.

A CPU convolution scheduled over a vector of output channels (``schedule_cpu``) reads its
weights as ``w[o // L, i, kh, kw, o % L]`` (L: the vector's lanes). When every call of that
kernel passes a weight of the model (a parameter of ``main`` after its inputs), the kernel
takes that layout as its parameter and the weight is repacked here, in numpy, once; otherwise
the kernel repacks it on every call (``weight_params`` says which it may take).

The packed weight is a new parameter of ``main`` named after the weight (``<name>_oc16``); the
original leaves ``main`` (and the graph's params) when nothing else reads it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.relax_util import CALL_TIR, bindings, op_name

__all__ = ["PACKS", "pack_columns", "pack_output_channels", "prepack", "weight_params"]


def pack_output_channels(w: np.ndarray, lanes: int) -> np.ndarray:
    """``(O, I, KH, KW)`` -> ``(O // lanes, I, KH, KW, lanes)``: output channels innermost."""
    o, i, kh, kw = w.shape
    return np.ascontiguousarray(w.reshape(o // lanes, lanes, i, kh, kw).transpose(0, 2, 3, 4, 1))


def _calls(func: relax.Function):
    for b in bindings(func):
        if op_name(b.value) == CALL_TIR:
            yield b, b.value.args[0].name_hint, list(b.value.args[1].fields)


def weight_params(mod, ctx: BuildContext) -> dict[str, set[int]]:
    """Per PrimFunc called from ``main``: the parameter positions that every call fills with a
    weight (a parameter of ``main`` after its inputs that holds a known value)."""
    func = mod["main"]
    if "num_input" not in (func.attrs or {}):
        return {}
    weights = {p for p in func.params[int(func.attrs["num_input"]):]
               if _value_key(p, ctx) is not None}
    found: dict[str, set[int]] = {}
    for _, name, args in _calls(func):
        here = {i for i, a in enumerate(args) if isinstance(a, relax.Var) and a in weights}
        found[name] = found[name] & here if name in found else here
    return found


def _value_key(p: relax.Var, ctx: BuildContext) -> str | None:
    w = ctx.weights
    key = w.source.get(w.graph_names.get(p.name, p.name))
    return key if key in w.values else None


def pack_columns(w: np.ndarray, cols: int) -> np.ndarray:
    """``(K, N)`` -> ``(ceil(N / cols), K, cols)``: each tile of ``cols`` columns contiguous,
    the last one zero-padded when ``cols`` does not divide ``N``."""
    k, n = w.shape
    tiles = -(-n // cols)
    if tiles * cols != n:
        w = np.concatenate([w, np.zeros((k, tiles * cols - n), w.dtype)], axis=1)
    return np.ascontiguousarray(w.reshape(k, tiles, cols).transpose(1, 0, 2))


PACKS = {"oc": pack_output_channels, "col": pack_columns}  # layout -> how to pack


def prepack(mod, ctx: BuildContext, packed: dict[str, tuple[int, int, str]]):
    """``main`` with the weights of ``packed`` (PrimFunc -> (parameter position, lanes, layout))
    replaced by their packed copies, recorded in ``ctx.weights``."""
    if not packed:
        return mod
    func = mod["main"]
    n_in = int(func.attrs["num_input"])
    new_params: dict[tuple[relax.Var, int], relax.Var] = {}
    # the packed kernels under new GlobalVars (an old one keeps the type of its unpacked
    # signature): added to a module without them by a BlockBuilder, which types them
    bb = relax.BlockBuilder(tvm.IRModule(
        {gv: f for gv, f in mod.functions_items() if gv.name_hint not in packed},
        attrs=mod.attrs, global_infos=mod.global_infos))
    fresh = {name: bb.add_func(mod[name], name) for name in packed}
    remap: dict[relax.Var, relax.Call] = {}
    for b, name, args in _calls(func):
        if name not in packed:
            continue
        pos, lanes, layout = packed[name]
        key = (args[pos], lanes, layout)
        if key not in new_params:
            new_params[key] = _packed_param(args[pos], lanes, layout, ctx,
                                            {p.name for p in func.params})
        args[pos] = new_params[key]
        out = b.var.ty  # a kernel with several outputs (a dense layer's dropout) has a tuple
        out = list(out.fields) if isinstance(out, relax.TupleType) else out
        remap[b.var] = relax.op.call_tir(fresh[name], relax.Tuple(args), out)
    blocks = [type(block)([relax.VarBinding(b.var, remap[b.var]) if b.var in remap else b
                           for b in block.bindings]) for block in func.body.blocks]
    body = relax.SeqExpr(blocks, func.body.body)
    used = set(relax.analysis.free_vars(body))
    w = ctx.weights
    params = list(func.params[:n_in])
    for p in func.params[n_in:]:
        if p in used:
            params.append(p)
        else:  # read only by repacking kernels: the packed copy replaces it
            w.source.pop(w.graph_names.pop(p.name, p.name), None)
    main = relax.Function(params + list(new_params.values()), body, func.ret_ty, func.is_pure,
                          func.attrs)
    new = bb.get()
    new.update_func(new.get_global_var("main"), main)
    return relax.transform.Normalize()(new)  # the new calls get their types


def _packed_param(p: relax.Var, lanes: int, layout: str, ctx: BuildContext, taken: set[str]
                  ) -> relax.Var:
    w = ctx.weights
    value = PACKS[layout](w.values[_value_key(p, ctx)], lanes)
    rname = f"{p.name}_{layout}{lanes}"
    while rname in taken or rname in w.graph_names:
        rname += "_"
    pname = w.free_name(f"{w.graph_names.get(p.name, p.name)}_{layout}{lanes}")
    w.graph_names[rname] = pname
    w.source[pname] = pname
    w.values[pname] = value
    return relax.Var(rname, relax.TensorType(value.shape, str(value.dtype),
                                             getattr(p.ty, "vdevice", None)))
