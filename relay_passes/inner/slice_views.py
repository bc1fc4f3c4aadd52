"""Copy kernels that read one contiguous range of their input become views of it at an offset.

A ``strided_slice`` along a leading axis (or any kernel that only copies element ``i`` of its
output from element ``i + c`` of its input) moves bytes that are already laid out as the
output wants them. A recurrent layer unrolled by the exporter slices its input projection once
per step: the corpus RNN (62 steps) ran 62 such kernels, 0.6 us each. Where the input's
element ``c`` starts at a multiple of ``ALIGN`` bytes (TVM's kernels may assume aligned data)
on a device whose pointers allow arithmetic, graph_codegen writes the call as a ``__slice``
node (a view at that byte offset: no step runs), and the memory plan keeps the input's bytes
live as long as any reader of the view. The Relax module keeps the call (the Relax VM, which
``lower_model``'s users run it on, passes no tensor at a byte offset to TVM's kernels).

``copy_offset`` reads the kernel's TIR, as lowering left it (one block in a loop nest, before
scheduling): one store ``out[v...] = in[idx...]`` whose flattened input index minus its
flattened output index simplifies to one constant ``c`` over the loops' ranges. That holds for
slices whose output is one run of the input's elements (every axis after the first that is not
whole, whole; every axis before it of extent 1 in the output) and for such a slice with a
reshape or squeeze fused after it, and for nothing that permutes or strides.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.sym.analyzer import Analyzer

from hgrt import devices as hdev
from hgrt.lifetimes import ALIGN
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.lowered import binding_devices
from hgrt.relay_passes.util.relax_util import CALL_TIR, bindings, op_name, prim_funcs


def _dims(shape) -> list[int] | None:
    dims = [getattr(d, "value", None) for d in shape]
    return None if None in dims else [int(d) for d in dims]


def _flat(indices, shape: list[int]):
    flat = 0
    for i, d in zip(indices, shape, strict=True):
        flat = flat * d + i
    return flat


def _loop_nest(func: tirx.PrimFunc) -> tuple[list[tirx.For], s_tir.stmt.SBlockRealize] | None:
    stmt = func.body
    if isinstance(stmt, s_tir.stmt.SBlockRealize) and not stmt.block.iter_vars:
        stmt = stmt.block.body  # the root block
    loops = []
    while isinstance(stmt, tirx.For):
        loops.append(stmt)
        stmt = stmt.body
    return (loops, stmt) if isinstance(stmt, s_tir.stmt.SBlockRealize) else None


def copy_offset(func: tirx.PrimFunc) -> int | None:
    """The element offset ``c`` such that ``func(in, out)`` computes ``out.flat[i] =
    in.flat[i + c]`` for every ``i``, or None (see the module doc for what is read)."""
    if len(func.params) != 2:
        return None
    src, dst = func.params
    s_dims, d_dims = _dims(src.ty.shape), _dims(dst.ty.shape)
    nest = _loop_nest(func)
    if s_dims is None or d_dims is None or nest is None or src.ty.dtype != dst.ty.dtype:
        return None
    loops, realize = nest
    block, store = realize.block, realize.block.body
    if (block.init is not None or not isinstance(store, tirx.BufferStore)
            or not isinstance(store.value, tvm.ir.expr.TensorLoad)
            or not store.buffer.same_as(dst) or not store.value.source.same_as(src)
            or len(realize.iter_values) != len(loops) or len(block.iter_vars) != len(loops)
            or [getattr(lp.extent, "value", None) for lp in loops] != d_dims
            or len(store.indices) != len(d_dims)):
        return None
    analyzer = Analyzer()
    for loop, value, iv, index in zip(loops, realize.iter_values, block.iter_vars,
                                      store.indices, strict=True):
        if not (value.same_as(loop.loop_var) and getattr(loop.min, "value", None) == 0
                and getattr(iv.dom.min, "value", None) == 0
                and getattr(iv.dom.extent, "value", None) == loop.extent.value
                and int(iv.iter_type) == 0 and index.same_as(iv.var)):
            return None
        analyzer.bind(iv.var, tvm.ir.Range.from_min_extent(0, loop.extent))
    diff = analyzer.simplify(_flat(store.value.indices, s_dims) - _flat(store.indices, d_dims))
    c = getattr(diff, "value", None)
    if not isinstance(c, int) or c < 0 or c + math.prod(d_dims) > math.prod(s_dims):
        return None
    return c


def slice_views(mod: tvm.IRModule, ctx: BuildContext) -> dict[relax.Var, int]:
    """The calls of ``mod`` (lowered, unscheduled) that graph_codegen may write as ``__slice``
    views, each with the byte offset it reads from: a ``copy_offset`` kernel of one tensor
    operand, the offset a multiple of ``ALIGN`` bytes, on a device that takes offset views."""
    funcs = prim_funcs(mod)
    main = mod["main"]
    dev = binding_devices(main, ctx)
    offsets: dict[str, int | None] = {}
    views: dict[relax.Var, int] = {}
    for b in bindings(main):
        call = b.value
        if op_name(call) != CALL_TIR or not isinstance(call.args[0], tvm.ir.GlobalVar):
            continue
        name = call.args[0].name_hint
        if name not in offsets:
            offsets[name] = copy_offset(funcs[name]) if name in funcs else None
        args = list(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else []
        if (offsets[name] is None or len(args) != 1 or not isinstance(args[0], relax.Var)
                or not isinstance(b.var.ty, relax.TensorType)
                or not hdev.takes_offset_views(ctx.devices[dev.get(b.var, 0)])):
            continue
        offset = offsets[name] * np.dtype(str(b.var.ty.dtype)).itemsize
        if offset % ALIGN == 0:
            views[b.var] = offset
    return views
