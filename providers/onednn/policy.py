"""Who computes a build's convolutions and dense layers, oneDNN or TVM: the provider policy
that ``claim_onednn`` applies to what ``Kernels`` (``relay_passes/util/kernels.py``) asks.

``onednn_runtime`` says whether this build uses oneDNN at all
(``"onednn"`` asked where it cannot run is a ``BuildError``; ``"auto"`` says once why not);
``AUTO_MIN_MACS`` is where ``"auto"`` leaves a small model to TVM; ``winograd_pays`` and
``choose_winograd`` pick the 3x3 convolutions that run as Winograd F(4x4, 3x3), within
``WINOGRAD_SHARE`` of the model's weight bytes and the devices' placement budgets
(``weight_room``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from hgrt.devices import resolve_device
from hgrt.errors import BuildError
from hgrt.providers.onednn import PROVIDER
from hgrt.providers.onednn import kernels as runtime
from hgrt.providers.onednn.blob import (
    ELTWISE_POST_OPS,
    HEADER_SLOTS,
    KIND,
    MAX_POST_OPS,
    POST_OP,
    SLOT,
    winograd_growth,
)
from hgrt.relay_passes.util.context import BuildContext
from hgrt.relay_passes.util.kernels import WINOGRAD_SHARE, Kernels
from hgrt.relay_passes.util.relax_util import MainReader

_log = logging.getLogger("hgrt.build")
_said: set[str] = set()
# "auto" leaves a model to TVM when all it would claim is fewer multiply-adds than this: a
# oneDNN call costs ~4.5 us where a small TVM kernel takes ~1.5 us, and a lone convolution
# adds reorders at its plain input and output (2 vCPUs, AVX-512: 16->16 3x3 on 8x8, 147k
# multiply-adds, 6.0 us TVM vs 9.3 us oneDNN; 32->32 3x3 on 16x16, 2.4M, 28.6 vs 28.6 us)
AUTO_MIN_MACS = 1 << 21


def runs_onednn(ctx: BuildContext, device: int) -> bool:
    """Whether oneDNN's kernels can run on device ``device`` of the build (``PROVIDER.serves``)."""
    return PROVIDER.serves(ctx.devices[device])


def onednn_runtime(ctx: BuildContext, kernels: Kernels) -> Any | None:
    """The oneDNN runtime when this build uses it, else None (saying why once)."""
    asked = [(where, p) for where, p in kernels.choices() if p in ("auto", PROVIDER.name)]
    if not asked:
        return None
    reason = runtime.unavailable_reason()
    if reason is None and not any(runs_onednn(ctx, d.index) for d in ctx.devices):
        reason = "no device of this build is an x86-64 CPU"
    if reason is None:
        return runtime
    for where, provider in asked:
        if provider == "onednn":
            raise BuildError(f"{where}='onednn': {reason}")
    if reason not in _said:
        _said.add(reason)
        _log.warning("kernels: tvm (%s)", reason)
    ctx.log(f"kernels: tvm ({reason})")
    return None


def winograd_pays(h: np.ndarray, nhwc: int) -> bool:
    """Whether the convolution of header ``h`` runs faster as Winograd F(4x4, 3x3) (the shim's
    Winograd kernels): a 3x3 stride-1 undilated ungrouped convolution between NHWC tensors, no
    pool, whose tiles of 4x4 output pixels are many enough and whose channels are balanced
    enough. Per tile the batched matmul does work in proportion to ``ic * oc`` (4x less than the
    direct convolution) and the transforms in proportion to ``ic + oc``: the rule asks
    ``ic * oc / (ic + oc)`` >= 16 over 36 tiles or more, >= 32 over 16-35 tiles (13x13 to 20x20
    outputs), none under 16 (a 7x7 output: the matmul reads its weights, 4x the direct ones,
    for 4 tiles). On an Intel Xeon (AVX-512, 2 vCPUs, ``hgrt profile --repeat 200``, two runs;
    BENCHMARKS.md, "Winograd's rule on the Xeon") squeezenet's 16 -> 64 on 55x55 (balance 12.8,
    196 tiles) took 239-261 us as Winograd against 175-186 us direct, and its 32 -> 128 on 27x27
    (balance 25.6) 145-168 against 176-181 us: hence 16, not 12, over many tiles. (The figures
    below: measured in the shim against oneDNN's direct convolution, the kernel timed inside a
    3-conv model, 2 threads, AMD EPYC, AVX-512 and an AVX2 build alike, us:) densenet121's
    128 -> 32 on 56x56 976 -> 455 (balance 26; on 28x28
    241 -> 114, but on 14x14 60 -> 51 (AVX2 79 -> 66) for 4x the weights: left direct),
    64 -> 16 on 28x28 68 -> 57 (AVX2 66 -> 63; balance 12.8: now direct), 16 -> 32 on 28x28
    36 -> 40 (AVX2; balance 11), 16 -> 16 on 56x56 69 -> 90 (AVX2), squeezenet's 48 -> 192 on
    13x13 118 -> 79, 64 -> 64 on 14x14 62 -> 41, 64 -> 32 on 14x14 34 -> 33 (AVX2 36 -> 39),
    128 -> 16 on 14x14 32 -> 39; inside whole models 512 -> 512 on
    7x7 (resnet50) 940 -> 1180 and inception's 7x7 layers 1.3-1.6x slower."""
    v = {name: int(h[SLOT[name]]) for name in HEADER_SLOTS}
    if v["kind"] != KIND["conv2d"] or (v["kh"], v["kw"], v["sh"], v["sw"], v["dil_h"],
                                       v["dil_w"], v["groups"]) != (3, 3, 1, 1, 1, 1, 1):
        return False
    has_sum = any(v[f"post{k}"] == POST_OP["sum"] for k in range(MAX_POST_OPS))
    if any(v[f"post{k}"] in (POST_OP[p] for p in ELTWISE_POST_OPS) for k in range(MAX_POST_OPS)):
        return False  # the Winograd kernels add relu, clip and sum only
    if v["src_dt"]:
        return False  # an int8 convolution runs direct (4x faster than float32 already)
    if v["pool_kh"] or v["src_tag"] != nhwc or v["dst_tag"] != nhwc \
            or (has_sum and v["res_tag"] != nhwc):
        return False
    tiles = v["n"] * -(-v["oh"] // 4) * -(-v["ow"] // 4)
    product, total = v["ic"] * v["oc"], v["ic"] + v["oc"]  # balance: product / total
    return (tiles >= 36 and product >= 16 * total) or (tiles >= 16 and product >= 32 * total)


def choose_winograd(headers: Sequence[tuple[Any, np.ndarray]], nhwc: int,
                    winograd: bool | float, plain_bytes: int) -> tuple[set[int], list]:
    """Of the convolutions ``headers`` lists (``(chain, its header)``), the ones (by id) to
    run as Winograd, and every one where it is faster (``winograd_pays``) with the bytes its
    weights would grow by (``(chain, growth)``, model order). ``winograd``: all of those
    (``True``), none (``False``), or, for a share, the most output tiles first while the
    weights' growth stays within that share of ``plain_bytes``, the model's weight bytes."""
    pays = []
    for c, h in headers:
        if winograd_pays(h, nhwc):
            tiles = int(h[SLOT["n"]]) * -(-int(h[SLOT["oh"]]) // 4) \
                * -(-int(h[SLOT["ow"]]) // 4)
            pays.append((c, tiles, winograd_growth(h)))
    candidates = [(c, growth) for c, _, growth in pays]
    if winograd is True or winograd is False:
        return ({id(c) for c, _, _ in pays} if winograd else set()), candidates
    room, chosen = float(winograd) * plain_bytes, set()
    for c, _, growth in sorted(pays, key=lambda t: -t[1]):  # stable: model order on ties
        if growth <= room:
            chosen.add(id(c))
            room -= growth
    return chosen, candidates


def weight_room(g: MainReader) -> dict[int, int]:
    """Device -> the bytes of weights it may still take, for the devices a placement budget
    bounds (``Placement.budgets``: what auto placement filled with the model's weights):
    Winograd's weights, 4x the direct ones, must fit in it too."""
    ctx = g.ctx
    budgets = getattr(ctx.placement, "budgets", None) or {}
    if not budgets:
        return {}
    room = {resolve_device(k, ctx.devices, "budget"): int(v) for k, v in budgets.items()}
    for p in g.func.params[int(g.func.attrs["num_input"]):]:
        dev = ctx.device_of_vdevice(getattr(p.ty, "vdevice", None))
        value = g.value(p)
        if dev in room and value is not None:
            room[dev] -= value.nbytes
    return room


def log_winograd(ctx: BuildContext, candidates: list, grown: list[int], plain_bytes: int,
                 winograd: bool | float) -> None:
    """What the Winograd choice costs in bytes against the model's plain weights:
    ``candidates`` as ``choose_winograd`` gives them, ``grown`` the growth of each convolution
    that runs as Winograd."""
    every = candidates
    if not every:
        return
    mib, plain = 2**20, max(plain_bytes, 1)
    took = sum(grown)
    rule = ("every one (winograd=True)" if winograd is True else "none (winograd=False)"
            if winograd is False else f"up to {float(winograd):.0%} of them (winograd="
            f"{winograd}{', the default' if winograd == WINOGRAD_SHARE else ''})")
    ctx.log(f"oneDNN: {len(grown)} of {len(every)} 3x3 convolutions where "
            f"Winograd F(4x4, 3x3) is faster run as Winograd, their weights "
            f"{took / mib:.1f} MiB larger: {took / plain:.0%} of the model's "
            f"{plain / mib:.1f} MiB of weights, growth allowed: {rule}; all {len(every)} would "
            f"add {sum(g for _, g in every) / mib:.1f} MiB (Kernels(winograd=True / False / a "
            f"share), --winograd)")
