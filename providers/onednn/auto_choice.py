"""Which of the chains that ``"auto"`` may give oneDNN it gives: per op by modelled time, the
switches between the two thread pools counted (``choose_auto``, for ``claim_onednn``).

oneDNN's kernels run on its OpenMP team, TVM's on TVM's own pool. Where a oneDNN kernel follows
a TVM kernel that ran on the pool (or the other way round), the workers of one pool must wake
while the other's spin down: a switch. On 2 cores (AMD EPYC, AVX-512) with the spin settings in
force (``hgrt/spin.py``), distilbert with its dense layers on oneDNN (36 switches) took 59.6
against 54.8 ms all on TVM, timed in turns in one process, and 208.8 against 203.3 ms beside a
busy process: 130-150 us a switch either way. (Before the spin settings took effect, libgomp's
idle threads spun for milliseconds over the next TVM kernels: 17 us a switch idle, 4 ms beside a
busy process.) Small elementwise TVM kernels next to oneDNN's run on the calling thread alone
(``threads.solo``) and TVM kernels of fewer than ``MIN_PARALLEL_WORK`` output elements serial
(the schedules' rule): neither wakes a pool.

A chain costs its multiply-adds at ``MAC_RATE`` on either side (a convolution's call cost is
left out: oneDNN's ~3 us more per call, ``policy.AUTO_MIN_MACS``, is about what the reorders
around a TVM op among NHWC oneDNN kernels cost; a dense layer or matmul counts it,
``ONEDNN_CALL_US``, and TVM's kernel on one core where it runs serial), except where TVM's
schedule is known to be slower: a dense
layer whose register tile holds a single row (``tile_rows``: a product of few column tiles over
rows that no tile divides) takes ``ONE_ROW_SLOWDOWN`` times as long, a convolution
``CONV_GAIN`` times; and oneDNN's side of a layer that computes in int8 (``Chain.int8_able``)
``INT8_GAIN`` times less.
Walking ``main``'s bindings in order, every other op that runs on TVM's pool (``on_pool``)
needs the TVM side, and a switch costs ``SWITCH_US``; the cheapest assignment (two states, one
pass) says which chains oneDNN keeps. The row ops oneDNN can take (``rows``: layer norms,
softmaxes, matmuls of two activations) are choices of the same pass: a matmul costs its
multiply-adds, the others the bytes they move (``ROW_BYTES_PER_US``), TVM's kernels
``ROW_TVM_SLOWDOWN`` times oneDNN's where its schedule is at its weakest (a matmul whose
register tile holds one row), else as fast. So a
transformer's layer norms and attention join its
dense layers on oneDNN where those go there (one run of oneDNN kernels, no switch inside: vit
224 -> 203 ms, swin 82 -> 56 ms, EPYC AVX-512, 2 threads), a CNN's convolutions go to oneDNN,
and where nothing else of a block does (a dense layer whose TVM tile is as fast as oneDNN's,
an op only TVM computes between) the switches keep it TVM's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from tvm import relax

from hgrt.devices import vector_isa
from hgrt.providers.onednn import channels_last, reasons
from hgrt.providers.onednn.chains import Chain, ChainGraph, find_chains
from hgrt.providers.onednn.rows import RowOp
from hgrt.relay_passes.inner.cpu_schedule_blocks import MIN_PARALLEL_WORK
from hgrt.relay_passes.inner.cpu_schedule_matmul import tile_rows
from hgrt.relay_passes.util.kernels import Kernels
from hgrt.relay_passes.util.relax_util import bindings, op_name, static_dims
from hgrt.relay_passes.util.relax_util import float32_shape as _shape

__all__ = ["SWITCH_US", "choose_auto", "keep_what_pays", "modelled_us", "on_pool"]

# multiply-adds per second and core of either provider's dense kernel at 16 float32 lanes (a
# register tile of several rows: 12 dense layers of 128 x 768 x 768 and their layer norms in
# 8.91 ms on 2 cores, AMD EPYC, AVX-512)
MAC_RATE = 52e9
# TVM's dense kernel with one row per register tile, against oneDNN's (2 cores, AVX-512):
# 197 x 768 x 768 4.08 against 2.03 ms, 197 x 768 x 3072 16.6 against 8.4 ms, 49 x 768 x 768
# 1.01 against 0.51 ms; 194, 198, 200 or 201 rows (tiles of 2 to 6 rows): within 5 %. Rows
# that no tile divides now get tiles of several rows and a part-filled last one where the
# column tiles give each core two (``tile_rows``): 197 x 768 x 3072 1.89 against oneDNN's
# 1.92 ms, so one row a tile is left to products of few columns
ONE_ROW_SLOWDOWN = 2.0
# TVM's dense kernel against oneDNN's where the target's vector ISA is narrower than the widest
# (2 cores, AMD EPYC, an AVX2 build for 2 cores with oneDNN capped to AVX2, ``python
# python/bench_ops.py``: 128 x 768 x 768 0.699 against 0.638 ms, 128 x 768 x 3072 2.814
# against 2.427 ms, 1.10x and 1.16x). (Built for one core, as targets given without
# -num-cores are, TVM's took 2.2x: 128 x 768 x 768 2.16 against 0.87 ms.) With 1.15 the AVX2
# table's choices stay as they were, and the lstm's two 32-row input projections go to TVM:
# 1.08-1.15 against 1.33-1.44 ms a run in that table's command
TVM_DENSE_BY_ISA = {"avx2": 1.15}
# ... but not for a single row, a vector times a weight that streams it from memory on either
# side. A product of fewer outputs than MIN_PARALLEL_WORK is a serial TVM kernel (one core of
# the target's), and a oneDNN call of a dense layer or matmul costs ONEDNN_CALL_US of its own
# (no reorder of a TVM kernel's operands offsets it there, as it does for convolutions among
# NHWC ones): an RNN unrolled into 62 steps of (1, 256) x (256, 256) and a tanh, built for
# AVX2, ran 628 us a run with its products on oneDNN (each a call, then the tanh alone) against
# 242 us all on TVM (``hgrt profile``, EPYC, 2 threads)
ONEDNN_CALL_US = 3.0
# oneDNN's int8 kernel against its float32 one where a chain computes in int8 (``int8``: VNNI),
# which TVM's kernels never do (their QDQ model's products stay float32): vit_int8's dense
# layers 27.4 ms in 73 int8 kernels against vit's 77.3 ms in 69 float32 ones (``hgrt
# profile``; 0.38 against 1.12 ms a layer); convolutions 3.9x (``int8``'s module doc)
INT8_GAIN = 3.0
# TVM's default convolutions against oneDNN's direct ones, whole CNNs on the same kernels
# (BENCHMARKS.md, oneDNN's zoo against the Relax VM on TVM's: 0.49-0.96, most 0.64-0.84)
CONV_GAIN = 1.5
# a layer norm's or softmax's bytes read and written per microsecond and core (either provider:
# vit's (197, 768) layer norm 21 us on oneDNN, 2 threads), and TVM's kernels of a row op
# against oneDNN's where TVM's schedule is at its weakest (EPYC AVX-512, 2 threads): vit's
# attention matmuls with one of 197 rows a register tile (as TVM's schedule tiled them before
# ``ragged_rows``), (12, 197, 64) x (12, 64, 197) 980 against 281 us and (12, 197, 197) x (12,
# 197, 64) 600 against 259 us; its softmax over rows of 197 with the NaN check after it, before
# TVM's reduced rows in vectors, 427 against 261 us. Elsewhere (128 rows: distilbert,
# llama) TVM's are as fast: all of distilbert on oneDNN took 68.9 ms, on TVM 56.4
ROW_BYTES_PER_US = 20e3
# Since TVM's softmax reduces rows in vectors with a short tail and its matmuls tile rows that
# no tile divides, vit's row ops take as long on either (``hgrt profile --top 1000`` of vit
# built with each provider's kernels): its 12 softmaxes over rows of 197 2.93 ms on TVM against
# 2.87 ms on oneDNN, its 24 attention matmuls 5.49 against 5.30 ms (and its dense layers 70.8
# against 77.3 ms on oneDNN, counted as equal): only a matmul with one row a tile is slower
ROW_TVM_SLOWDOWN = 2.5
# what a switch between the thread pools is counted at: twice the 130-150 us measured (above).
# Against 3 ms, in turns in one process (EPYC, AVX-512, 2 cores): vit 257 -> 224 ms, swin 69.7
# -> 62.5, convnext 69.5 -> 63.3, gpt2 161 -> 159, distilbert and t5_encoder within 1 %
SWITCH_US = 300.0
# ops that become elementwise or layout kernels: up to SOLO_BYTES of output they run on the
# calling thread next to oneDNN's kernels (runtime/frames.py: SOLO_MAX_BYTES), waking no pool
ELEMENTWISE = frozenset(f"relax.{op}" for op in (
    "add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "negative", "abs",
    "exp", "log", "sqrt", "rsqrt", "erf", "tanh", "sigmoid", "clip", "round", "floor", "ceil",
    "nn.relu", "nn.gelu", "nn.gelu_tanh", "nn.silu", "nn.leakyrelu", "nn.batch_norm",
    "quantize", "dequantize", "astype", "reshape", "permute_dims", "expand_dims", "squeeze",
    "flatten", "broadcast_to",
    "strided_slice", "concat", "split", "take", "where", "equal", "not_equal", "less",
    "greater", "less_equal", "greater_equal", "zeros_like", "ones_like", "full_like"))
SOLO_BYTES = 4 << 20
# ops that oneDNN computes itself where their inputs are NHWC, between its kernels
# (``channels_last``: pools, concat, ONNX's LRN with its 3-D average pool): no switch there
BESIDE = channels_last.POOLS | {"relax.concat", "relax.nn.avg_pool3d"}


def on_pool(b: relax.VarBinding) -> bool:
    """Whether binding ``b`` becomes a TVM kernel that runs on TVM's pool: anything but an
    elementwise or layout op of at most ``SOLO_BYTES`` of output, an op of ``BESIDE`` or no
    kernel at all."""
    op = op_name(b.value)
    if op is None or op in BESIDE or op in ("relax.to_vdevice", "relax.hint_on_device"):
        return False
    if op not in ELEMENTWISE:
        return True
    ty = b.var.ty
    fields = ty.fields if isinstance(ty, relax.TupleType) else [ty]
    dims = [static_dims(t) for t in fields]
    if any(d is None for d in dims):
        return True
    nbytes = sum(math.prod(d) * np.dtype(str(t.dtype)).itemsize
                 for d, t in zip(dims, fields, strict=True))
    return nbytes > SOLO_BYTES


def modelled_us(chain: Chain | RowOp, ctx: Any) -> dict[str, float]:
    """Microseconds ``chain`` is modelled to take on each provider."""
    target = ctx.devices[ctx.placed.op_device[chain.root.var.name]].target
    isa = vector_isa(target)
    cores = int(target.attrs.get("num-cores", 1) or 1)
    work = chain.macs / (MAC_RATE * cores * isa.lanes() / 16) * 1e6
    int8 = INT8_GAIN if getattr(chain, "int8_able", False) else 1.0
    if isinstance(chain, RowOp):  # a matmul by its MACs, the others by the bytes they move
        return _row_us(chain, work, cores, isa)
    if chain.kind == "dense":
        x = _shape(chain.x)
        slow = x[-2] > 1 and tile_rows(x[-2], chain.weight.shape[0], isa,
                                       math.prod(x[:-2]), cores) <= 1
        tvm = work * (ONE_ROW_SLOWDOWN if slow else 1.0) * _isa_factor(isa, x[-2])
        return _small_product(chain, work / int8, tvm, cores)
    return {"onednn": work / int8, "tvm": work * CONV_GAIN}


def _small_product(op: Chain | RowOp, onednn: float, tvm: float, cores: int
                   ) -> dict[str, float]:
    """A dense layer's or matmul's modelled microseconds with oneDNN's call cost
    (``ONEDNN_CALL_US``) and TVM's kernel on one core where it runs serial (fewer outputs
    than ``MIN_PARALLEL_WORK``)."""
    serial = _elements(op.root.var) < MIN_PARALLEL_WORK
    return {"onednn": onednn + ONEDNN_CALL_US, "tvm": tvm * (cores if serial else 1)}


def _isa_factor(isa: Any, rows: int) -> float:
    """TVM's dense kernel against oneDNN's on ``isa`` for a product of ``rows`` rows
    (``TVM_DENSE_BY_ISA``; 1 for a single row)."""
    return TVM_DENSE_BY_ISA.get(isa.name, 1.0) if rows > 1 else 1.0


def _row_us(op: RowOp, work: float, cores: int, isa: Any) -> dict[str, float]:
    """A row op's modelled microseconds (``modelled_us``): TVM's kernel slower where its
    schedule is (``ROW_TVM_SLOWDOWN``: a matmul whose register tile holds one row), else as
    fast."""
    dims = static_dims(op.root.var.ty) or (1, 1)  # (a matmul's end may be its result transposed)
    if op.kind == "matmul":
        rows, cols = dims[-2], dims[-1]
        slow = rows > 1 and tile_rows(rows, cols, isa, math.prod(dims[:-2]), cores) <= 1
        tvm = work * _isa_factor(isa, rows) * (ROW_TVM_SLOWDOWN if slow else 1.0)
        return _small_product(op, work, tvm, cores)
    work = 8 * op.elements / (ROW_BYTES_PER_US * cores)
    return {"onednn": work, "tvm": work}


def _elements(var: relax.Var) -> int:
    dims = static_dims(var.ty)
    return math.prod(dims) if dims is not None else MIN_PARALLEL_WORK


def _options(b: relax.VarBinding, chain: Chain | RowOp | None,
             ctx: Any) -> list[tuple[str, str | None, float]]:
    """What binding ``b`` may run as: ``(provider, the pool it leaves awake (None: the one
    that was), modelled us)``. A TVM kernel with fewer than ``MIN_PARALLEL_WORK`` output
    elements runs serial on the calling thread (the schedules' rule): it wakes no pool."""
    pool = "tvm" if _elements(b.var) >= MIN_PARALLEL_WORK else None
    if chain is None:
        return [("tvm", pool, 0.0)]
    us = modelled_us(chain, ctx)
    options = [("onednn", "onednn", us["onednn"])]
    if chain.choice == "auto":
        options.append(("tvm", pool, us["tvm"]))
    return options


def choose_auto(g: ChainGraph, chains: list[Chain | RowOp]
                ) -> tuple[set[int], dict[str, float]]:
    """The chains (by id) that oneDNN computes: those asked for by name (``choice ==
    "onednn"``) and the ``"auto"`` ones where the cheapest assignment of ``main`` puts them (see
    the module's doc) in ``g``'s ``main``; and that assignment's modelled microseconds, and
    with every ``"auto"`` chain on TVM's side (``{"chosen": .., "tvm": ..}``). The members of a
    composite (``channels_last``: ONNX's LRN, a channel shuffle) count as one oneDNN op."""
    roots = {c.root.var: c for c in chains}
    absorbed = {v for c in chains for v in c.members[1:]}
    for comp in channels_last.find_composites(g).values():  # one oneDNN primitive each
        absorbed.update([*comp.members, comp.end])
    cost = {"tvm": 0.0, "onednn": 0.0}  # the cheapest so far, by the pool left awake
    steps: list[tuple[Chain | None, dict[str, tuple[str, str]]]] = []
    all_tvm = 0.0
    for b in bindings(g.func):
        chain = roots.get(b.var)
        if chain is None and (b.var in absorbed or not on_pool(b)):
            continue
        options = _options(b, chain, g.ctx)
        all_tvm += options[-1][2]
        new: dict[str, float] = {}
        came: dict[str, tuple[str, str]] = {}  # pool awake -> (the one before, provider)
        for provider, pool, us in options:
            for before, so_far in cost.items():
                after = pool or before
                total = so_far + us + (SWITCH_US if after != before else 0.0)
                if total < new.get(after, math.inf):
                    new[after], came[after] = total, (before, provider)
        cost = {state: new.get(state, math.inf) for state in cost}
        steps.append((chain, came))
    state = min(cost, key=lambda s: (cost[s], s != "tvm"))  # a tie: TVM's
    best, chosen = cost[state], set()
    for chain, came in reversed(steps):
        state, provider = came[state]
        if chain is not None and provider == "onednn":
            chosen.add(id(chain))
    return chosen, {"chosen": best, "tvm": all_tvm}


def keep_what_pays(func: relax.Function, ctx: Any, kernels: Kernels, g: ChainGraph,
                   chains: list[Chain], rows: list[RowOp]
                   ) -> tuple[ChainGraph, list[Chain], list[RowOp]]:
    """``(g, chains, rows)`` without the ``"auto"`` chains and row ops that ``choose_auto``
    leaves to TVM (the chains found anew, those roots TVM's as if an override said so), the
    choice in the build log."""
    chosen, us = choose_auto(g, [*chains, *rows])
    kept_rows = [r for r in rows if id(r) in chosen]
    if len(kept_rows) < len(rows):
        ctx.log(f"kernels: tvm for {len(rows) - len(kept_rows)} of the {len(rows)} layer norms, "
                f"softmaxes and matmuls of two activations oneDNN could take (auto)")
    left = [c for c in chains if id(c) not in chosen]
    if not left:
        return g, chains, kept_rows
    ctx.log(f"kernels: tvm for {len(left)} of the {len(chains)} ops oneDNN could take (auto: "
            f"modelled {us['chosen'] / 1e3:.2f} ms with a switch between thread pools at "
            f"{SWITCH_US:.0f} us, against {us['tvm'] / 1e3:.2f} ms all on TVM): "
            + ", ".join(sorted({"+".join(c.label) for c in left})))
    tvm_roots = {c.root.var.name: "tvm" for c in left}
    again = dataclasses.replace(kernels, overrides={**kernels.overrides, **tvm_roots})
    g = ChainGraph(func, ctx)
    g.claimed.update(v for r in kept_rows for v in r.members)  # (no chain grows into them)
    chains = find_chains(g, again)
    reasons.switches_cost_more(ctx, left, {id(c): modelled_us(c, ctx) for c in left}, SWITCH_US)
    return g, chains, kept_rows
