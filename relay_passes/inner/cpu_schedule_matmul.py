"""The default CPU schedule of a matrix product of any rank (``cpu_schedule`` calls it before
the generic register tile): ``C[b.., i, j] = sum_k A[b.., i, k] * B[b.., k, j]``, batch
dimensions broadcast in either operand (a constant index), ``B`` read as ``B[b.., j, k]`` too
(a transposed operand), a weight or an activation (attention's ``QK^T`` and ``xV``).

The tile: a vector of ``vf`` columns ``j`` (one to four SIMD registers) times up to 8 rows
``i``, accumulated in registers over the whole reduction ``k``, the elementwise epilogue
(bias, GELU, a residual add) on its write-back. Loops outside the tile run column tiles
outside row tiles: each ``K x vf`` slab of ``B`` is read for every row of ``A`` while it is
in cache, and ``A`` (the activation's rows) is the operand read again, so a weight much
larger than the activation (a language model's head) streams from memory once.

A weight ``B[k, j]`` (a parameter of the model) is read packed as ``B[j // vf, k, j % vf]``,
each slab contiguous (``prepack_weights`` packs it at build), zero-padded to whole tiles when
``vf`` does not divide the columns (GPT-2's 50257). Such ragged column tiles are computed under
a predicate that only the last tile needs: the loop of column tiles carries a partition hint
and lowering peels that tile off (``peel_ragged_tiles``). A transposed ``B`` that is not a
weight is packed into that layout by the kernel itself, once per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tvm import s_tir, tirx

from hgrt.devices import VectorISA
from hgrt.relay_passes.inner.cpu_schedule_blocks import (
    MAX_TILE_ROWS,
    MIN_PARALLEL_WORK,
    divisors,
    inline_epilogue,
    iter_loops,
    param_position,
    vector_factor,
)
from hgrt.relay_passes.inner.cpu_schedule_conv import PEEL_HINT

__all__ = ["matmul_parts", "schedule_matmul", "tile_rows"]

Axis = tuple[tirx.Var, object, int]  # (block var, loop rv, extent)


@dataclass
class MatmulParts:
    """The axes of a matrix-product block and which read is which operand."""

    batch: list[Axis]
    row: Axis | None  # i (None: A has no row axis of its own, a vector times a matrix)
    col: Axis  # j: the output's last axis
    k: Axis
    b_read: int  # the read of B (indexed by j and k)
    b_transposed: bool  # B read as B[.., j, k]


def _index_vars(idx: list[tirx.Expr], block_vars: set) -> list[tirx.Var] | None:
    """The block vars of a read's indices, None unless each is a block var or a constant."""
    out = []
    for e in idx:
        if isinstance(e, tirx.IntImm):
            continue
        if not isinstance(e, tirx.Var) or e not in block_vars:
            return None
        out.append(e)
    return out


def matmul_parts(sch: s_tir.Schedule, block_rv) -> MatmulParts | None:
    """The parts of ``block_rv`` when it is a plain matrix product (one reduction, two reads,
    each index a block var or a constant, the output indexed by the spatial vars in order)."""
    info = iter_loops(sch, block_rv)
    if not info or [k for k, _, _, _ in info].count("R") != 1 or info[-1][0] != "R":
        return None
    block = sch.get(block_rv)
    if len(block.reads) != 2 or len(block.writes) != 1 or len(info) < 3:
        return None
    spatial = [(v, lp, e) for kind, v, lp, e in info if kind == "S"]
    k = (info[-1][1], info[-1][2], info[-1][3])
    out = [r.min for r in block.writes[0].region]
    if len(out) != len(spatial) or any(not o.same_as(v) for o, (v, _, _) in zip(
            out, spatial, strict=True)):
        return None
    col = spatial[-1]
    names = {v for v, _, _ in spatial} | {k[0]}
    reads = [_index_vars([r.min for r in rd.region], names) for rd in block.reads]
    if any(r is None or len(r) < 2 for r in reads):
        return None
    b_read = next((n for n, r in enumerate(reads) if col[0] in r[-2:]), None)
    if b_read is None:
        return None
    a, b = reads[1 - b_read], reads[b_read]
    if b[-2:] == [k[0], col[0]]:
        transposed = False
    elif b[-2:] == [col[0], k[0]]:
        transposed = True
    else:
        return None
    if col[0] in a or k[0] not in a or a.count(k[0]) != 1 or len(set(b)) != len(b):
        return None
    rows = [s for s in spatial[:-1] if s[0] in a and s[0] not in b]
    row = rows[-1] if rows else None
    batch = [s for s in spatial[:-1] if s is not row]
    return MatmulParts(batch, row, col, k, b_read, transposed)


def _column_tile(n: int, lanes: int) -> tuple[int, bool] | None:
    """``(vf, ragged)``: columns per tile, four, two or one whole registers where they divide
    ``n`` (three registers' worth, a vector LLVM splits unevenly, ran 20x slower); four with a
    ragged last tile from four registers' worth of columns on; below that a divisor of ``n``
    (``vector_factor``: one part-filled register) or two registers with a ragged last tile;
    None when nothing fits."""
    for regs in (4, 2, 1):
        if n % (regs * lanes) == 0:
            return regs * lanes, False
    if n >= 4 * lanes:
        return 4 * lanes, True
    vf = vector_factor(n, lanes)
    if vf is not None:
        return vf, False
    return (2 * lanes, True) if n >= 2 * lanes else None


def _row_limit(vf: int, isa: VectorISA) -> int:
    """The most rows a register tile of ``vf`` columns holds: its accumulators (rows x
    registers per row), a row of ``B`` (registers per row) and the broadcast value of ``A``
    in the vector registers. (Three quarters of them for the accumulators alone gave AVX2's
    16 registers tiles of 3 x 4 registers, which spill: 197 x 768 x 3072 and 195 x 768 x 3072
    in 7.3-8.6 ms against 4.3-4.5 ms at 2 rows, EPYC, 2 cores, ``hgrt.build`` alone.)"""
    nvec = -(-vf // isa.lanes())
    return max(1, min(MAX_TILE_ROWS, (isa.registers - nvec - 1) // nvec))


def _tile_rows(m: int, vf: int, isa: VectorISA) -> int:
    """Rows of the register tile: the largest divisor of ``m`` up to ``_row_limit``."""
    limit = _row_limit(vf, isa)
    return max(d for d in divisors(m) if d <= limit)


def ragged_rows(m: int, vf: int, isa: VectorISA) -> int:
    """Rows of a register tile that does not divide ``m`` (0: none), where no divisor comes
    within half of ``_row_limit`` (ViT's 197 rows, a prime: one row a tile read each ``K x vf``
    slab of ``B`` for a single row of ``A``): the limit itself, since each tile reads the slab
    once; the last, part-filled tile is peeled off and computes its rows only."""
    limit = _row_limit(vf, isa)
    return 0 if m <= limit or 2 * _tile_rows(m, vf, isa) > limit else limit


def tile_rows(m: int, n: int, isa: VectorISA, batch: int = 1, cores: int = 1) -> int:
    """Rows of the register tile this schedule gives ``batch`` products of ``m x n`` on
    ``cores`` (0: it tiles none): with one row a tile reads its ``K x vf`` slab of ``B`` for
    a single row of ``A``."""
    tile = _column_tile(n, isa.lanes())
    return 0 if tile is None else _rows_of(m, n, *tile, batch, isa, cores)[0]


def _rows_of(m: int, n: int, vf: int, ragged: bool, batch: int, isa: VectorISA, cores: int
             ) -> tuple[int, bool]:
    """``(rows of the register tile, whether its last tile is part-filled)``: ragged rows
    (``ragged_rows``) where the loop outside them, the column tiles and batch, gives each
    core two tiles or more, since the row tiles then stay out of the parallel loop; else a
    divisor of the rows."""
    rf = ragged_rows(m, vf, isa)
    if rf and (cores <= 1 or ragged or batch * -(-n // vf) >= 2 * cores):
        return rf, True
    return _tile_rows(m, vf, isa), False


def _row_tile(p: MatmulParts, vf: int, ragged: bool, isa: VectorISA, cores: int
              ) -> tuple[int, bool]:
    """``_rows_of`` the product's axes (1 row where ``A`` has no row axis of its own)."""
    if p.row is None:
        return 1, False
    batch = math.prod(e for _, _, e in p.batch)
    return _rows_of(p.row[2], p.col[2], vf, ragged, batch, isa, cores)


def _pack_weight(sch: s_tir.Schedule, block_rv, p: MatmulParts, source: tirx.Buffer, vf: int,
                 ragged: bool, weights: frozenset[int]) -> tuple[int, int, str] | None:
    """Read a weight ``B[k, j]`` as ``B[j // vf, k, j % vf]`` (returned: its parameter
    position, ``vf``, ``"col"``). Done last: a padded layout adds a block of assumptions about
    the padding, after which the scope takes no more loop primitives."""
    position = param_position(sch, source)
    if p.b_transposed or position not in weights or len(source.shape) != 2:
        return None
    # (the reads moved: the update block reads its accumulator too)
    read = next(i for i, r in enumerate(sch.get(block_rv).reads) if r.source.same_as(source))
    pad = tirx.FloatImm(source.dtype, 0.0) if ragged else None
    sch.transform_layout(block_rv, ("read", read), lambda k, c: (c // vf, k, c % vf),
                         pad_value=pad)
    return position, vf, "col"


def _pack_transposed(sch: s_tir.Schedule, block_rv, p: MatmulParts, vf: int, cores: int
                     ) -> None:
    """Copy a transposed ``B[.., j, k]`` into ``[.., j // vf, k, j % vf]`` in the kernel."""
    rank = len(sch.get(block_rv).reads[p.b_read].source.shape)
    packed = sch.cache_read(block_rv, p.b_read, "global")

    def tiles(*idx):  # [.., j, k] -> [.., j // vf, k, j % vf]
        return (*idx[:rank - 2], idx[-2] // vf, idx[-1], idx[-2] % vf)

    sch.transform_layout(packed, ("write", 0), tiles)
    copy = sch.get_loops(packed)
    if cores > 1 and int(sch.get(copy[0]).extent) > 1:
        sch.parallel(copy[0])


def schedule_matmul(sch: s_tir.Schedule, block_rv, isa: VectorISA, cores: int = 1,
                    weights: frozenset[int] = frozenset()) -> tuple[int, int, str] | bool:
    """Register-tile a matrix product (see the module's docstring); False when ``block_rv``
    is none or its columns fill no vector. Returns what a packed weight needs, else True."""
    p = matmul_parts(sch, block_rv)
    if p is None:
        return False
    tile = _column_tile(p.col[2], isa.lanes())
    if tile is None or p.b_transposed and tile[1]:
        return False
    vf, ragged = tile
    b_source = sch.get(block_rv).reads[p.b_read].source
    rf, peel_rows = _row_tile(p, vf, ragged, isa, cores)
    if p.b_transposed:
        _pack_transposed(sch, block_rv, p, vf, cores)
    jo, ji = sch.split(p.col[1], [None, vf])
    batch = [lp for _, lp, _ in p.batch]
    rows, inner = [], [ji]
    if p.row is not None and rf > 1:
        io, ii = sch.split(p.row[1], [None, rf])
        rows, inner = [io], [ii, ji]
        if peel_rows:  # the row tiles a loop of their own: the last one is peeled off
            sch.annotate(io, PEEL_HINT, 1)
    elif p.row is not None:
        rows = [p.row[1]]
    work = math.prod(e for _, _, e in [*p.batch, p.col] + ([p.row] if p.row else []))
    if ragged:  # the column tiles alone in parallel: the last one is peeled off
        sch.reorder(jo, *batch, *rows, p.k[1], *inner)
        sch.annotate(jo, PEEL_HINT, 1)
        if cores > 1:
            sch.parallel(jo)
        at = ([jo] + batch + rows)[-1]
    else:
        sch.reorder(*batch, jo, *rows, p.k[1], *inner)
        outer = [*batch, jo] if peel_rows else [*batch, jo, *rows]
        at = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if work >= MIN_PARALLEL_WORK and cores > 1 and int(sch.get(at).extent) > 1:
            sch.parallel(at)
        at = rows[0] if peel_rows else at
    _accumulate(sch, block_rv, at, p.k[1], rf)
    return _pack_weight(sch, block_rv, p, b_source, vf, ragged, weights) or True


def _accumulate(sch: s_tir.Schedule, block_rv, at, k_loop, rf: int) -> None:
    """Accumulate the tile in a tile-sized buffer written back under ``at`` (the epilogue on
    its write-back), the column vector vectorized, the rows unrolled, the init before ``k``."""
    wb = sch.cache_write(block_rv, 0, "global")
    inline_epilogue(sch, wb)
    sch.reverse_compute_at(wb, at, preserve_unit_loops=True)
    wb_loops = sch.get_loops(wb)
    if int(sch.get(wb_loops[-1]).extent) > 1:
        sch.vectorize(wb_loops[-1])
    loops = sch.get_loops(block_rv)
    sch.vectorize(loops[-1])
    if rf > 1:
        sch.unroll(loops[-2])
    sch.decompose_reduction(block_rv, k_loop)
