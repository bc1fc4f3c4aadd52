"""Blocked activations at large batches: which NHWC tensors of a channels-last plan oneDNN's
convolutions hold in its blocked layout instead (``blocked``; nChw16c on AVX-512, nChw8c on
AVX2), and their graph type (``blocked_type``)."""

from __future__ import annotations

from typing import Any

from tvm import relax

from hgrt.providers.onednn.channels_last import Plan
from hgrt.relay_passes.util.relax_util import float32_shape as _shape

# the batch from which tensors between convolutions go blocked (``blocked``): at 8 samples,
# oneDNN's direct kernels on nChw16c against its brgemm ones on NHWC (EPYC, AVX-512, 2
# threads, us; python/bench_onednn_primitives.cc): a 3x3 depthwise on 144 channels at 56x56
# 634 against 996, a 1x1 16 -> 96 at 112x112 1516 against 2208, a 1x1 32 -> 16 455 against
# 527 (a 1x1 24 -> 144 at 56x56 1041 against 854: not every layer; mobilenet_v2 as a whole
# 35.2 -> 29.0 ms); at one sample NHWC's were as fast or faster (the depthwise 60 against 77)
BLOCKED_MIN_BATCH = 8
# ... but not around a dense convolution wider than 1x1 of this many input channels or more:
# there brgemm on NHWC wins at 8 samples (``layout`` of bench_onednn_primitives.cc, us, NHWC
# against blocked: 3x3 128 -> 128 at 28x28 3359 against 3576, at 14x14 808 against 903;
# 256 -> 256 at 14x14 3177 against 3642; 512 -> 512 at 7x7 3108 against 3672; AVX2 with
# nChw8c 128 -> 128 at 28x28 6640 against 7038), where below it the two are within 2-7 %
# either way (64 -> 64 at 56x56 3582 against 3637; AVX2 7031 against 6750)
NHWC_MIN_CHANNELS = 128
# A convolution whose tensors change layout pays for it (batch 8, resnet's bottlenecks,
# ``hgrt profile``: a 1x1 64 -> 256 at 56x56 2.19 ms with its input, result and residual
# blocked, 4.07 ms with the residual NHWC, 4.83 ms writing NHWC; a 1x1 stride-2 256 -> 512
# writing blocked from NHWC 4.58 against 4.09 ms for one of as many multiply-adds in NHWC),
# and the layers that gain from the blocked layout are the depthwise ones (above) and the
# narrowest 1x1s, which come with them: a group of tensors that share convolutions goes blocked
# only where one of those convolutions is depthwise (``_depthwise``)


def _prefers_nhwc(chain: Any) -> bool:
    """A convolution of one group, a window wider than 1x1, ``NHWC_MIN_CHANNELS`` inputs or
    more (its weight: OIHW)."""
    o, i, kh, kw = chain.weight.shape
    return int(chain.root.value.attrs.groups) == 1 and kh * kw > 1 and i >= NHWC_MIN_CHANNELS


def _depthwise(chain: Any) -> bool:
    """A convolution of one input channel per group, several groups (its weight: OIHW)."""
    return chain.weight.shape[1] == 1 and int(chain.root.value.attrs.groups) > 1


def _with_depthwise(chosen: set[relax.Var], convs: list[Any]) -> set[relax.Var]:
    """The tensors of ``chosen`` in groups (tensors joined by a convolution that reads or
    writes both: input, result, residual) where some convolution is depthwise."""
    parent = {v: v for v in chosen}

    def find(v: relax.Var) -> relax.Var:
        while parent[v] is not v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    touched = []
    for c in convs:
        mine = [v for v in (c.x, c.end, c.residual) if v is not None and v in parent]
        for v in mine[1:]:
            parent[find(v)] = find(mine[0])
        if mine:
            touched.append((mine[0], _depthwise(c)))
    keep = {find(v) for v, dw in touched if dw}
    return {v for v in chosen if find(v) in keep}


def blocked_type(var: relax.Var, block: int) -> relax.TensorType:
    """The type of an NCHW tensor ``var`` held in oneDNN's nChw<block>c layout: N, C / block
    (rounded up: oneDNN pads the channels), H, W, block."""
    n, c, h, w = _shape(var)
    return relax.TensorType((n, -(-c // block), h, w, block), "float32", var.ty.vdevice)


def blocked(plan: Plan, g: Any, chains: list[Any]) -> set[relax.Var]:
    """The NHWC tensors of ``plan`` to hold blocked instead (``blocked_type``): of at least
    ``BLOCKED_MIN_BATCH`` samples, written by a float32 convolution chain without a pool and
    read only by float32 convolution chains, as their input or residual (no other op ever
    sees the layout), none of which ``_prefers_nhwc``, where those chains' other tensors may
    be blocked too: the writer's input and the readers' results, in a group of such tensors
    with a depthwise convolution (``_with_depthwise``). (A convolution between a blocked and an
    NHWC tensor reorders its result; EfficientNet's blocks, whose depthwise results a
    squeeze-excite reads, would take two reorders each, and stay NHWC.)"""
    convs = [c for c in chains if c.kind == "conv2d" and c.grid is None]
    writer = {c.end: c for c in convs if c.pool is None}
    reader = {c.root.var: c for c in convs} | {c.residual_at: c for c in convs
                                                 if c.residual_at is not None}
    maybe = {v for v in plan.nhwc & set(writer) if _shape(v)[0] >= BLOCKED_MIN_BATCH
             and all(u is not None and u.var in reader for u in g.users.get(v, [None]))
             and not _prefers_nhwc(writer[v])
             and not any(_prefers_nhwc(reader[u.var]) for u in g.users[v])}

    def fits(v: relax.Var) -> bool:  # in a layout the candidates share, or none (plain)
        return v in maybe or v not in plan.nhwc
    return _with_depthwise({v for v in maybe if fits(writer[v].x)
                            and all(fits(reader[u.var].end) for u in g.users[v])}, convs)
