"""The GPU benchmark's bundle (``.gpu/`` at the repository root): its layout, and the weights
that do not travel in it.

A model's weights are written as recipes where they are large floats: each becomes seeded
normal numbers with the original's mean and standard deviation (per row along axis 0 where
there are at most ``ROW_STATS_MAX`` rows), regenerated on the GPU machine. Small tensors
(norm scales, rotary cos/sin tables, scalars), integer tensors, tensors that are not finite
everywhere, tensors of a few distinct values (masks of 0 and float32's min) and tensors whose
values repeat (position bias tables gathered out at build) travel as they are. Every build
of a model (cuda only, auto, cpu only, the Relax VM) takes its weights from the same base
tensors, some of them in a layout packed at build (``<name>_col32``, ``<name>_oc16``), so the
builds compute the same function and their outputs can be compared.

numpy and the standard library only: the GPU machine reads this before TVM is importable.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable

import numpy as np

FORMAT = 1
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(REPO, ".gpu")
BUNDLE_FILE = "bundle.json"
MODEL_FILE = "model.json"
SMALL_FILE = "small.npz"
KERNELS_DIR = "kernels"  # compiled CUDA kernels, by the sha256 of their source
TRAVEL_BYTES = 64 << 10  # float tensors above this become recipes
ROW_STATS_MAX = 4096
FEW_VALUES = 16  # a float tensor of at most this many distinct values travels (a mask, a table)
# a float tensor whose values repeat (each TABLE_REPEATS times on average, at most TABLE_VALUES
# of them) travels too: a small table gathered out at build (T5's relative position bias,
# folded to (1, heads, seq, seq)), which noise of its mean and deviation would not stand for
# (and xz packs it small)
TABLE_VALUES = 4096
TABLE_REPEATS = 64

# the CPU schedules' weight layouts (hgrt.relay_passes.inner.prepack_weights.PACKS): the
# prepare step checks that these give byte for byte the weights of each build
_PACKED_NAME = re.compile(r"(.+)_(col|oc)(\d+)")


def pack_columns(w: np.ndarray, cols: int) -> np.ndarray:
    """``(K, N)`` -> ``(ceil(N / cols), K, cols)``, the last tile zero-padded."""
    k, n = w.shape
    tiles = -(-n // cols)
    if tiles * cols != n:
        w = np.concatenate([w, np.zeros((k, tiles * cols - n), w.dtype)], axis=1)
    return np.ascontiguousarray(w.reshape(k, tiles, cols).transpose(1, 0, 2))


def unpack_columns(p: np.ndarray, cols: int) -> np.ndarray:
    tiles, k, _ = p.shape
    return np.ascontiguousarray(p.transpose(1, 0, 2).reshape(k, tiles * cols))


def pack_output_channels(w: np.ndarray, lanes: int) -> np.ndarray:
    """``(O, I, KH, KW)`` -> ``(O // lanes, I, KH, KW, lanes)``."""
    o, i, kh, kw = w.shape
    return np.ascontiguousarray(w.reshape(o // lanes, lanes, i, kh, kw).transpose(0, 2, 3, 4, 1))


def unpack_output_channels(p: np.ndarray, lanes: int) -> np.ndarray:
    blocks, i, kh, kw, _ = p.shape
    return np.ascontiguousarray(p.transpose(0, 4, 1, 2, 3).reshape(blocks * lanes, i, kh, kw))


PACKS: dict[str, tuple[Callable, Callable]] = {
    "col": (pack_columns, unpack_columns), "oc": (pack_output_channels, unpack_output_channels)}


def packed_name(name: str) -> tuple[str, str, int] | None:
    """``("w", "col", 32)`` for ``"w_col32"``; None for a name of no packed layout."""
    m = _PACKED_NAME.fullmatch(name)
    return (m.group(1), m.group(2), int(m.group(3))) if m and m.group(2) in PACKS else None


def seed_of(model: str, base: str) -> int:
    return zlib.crc32(f"{model}/{base}".encode())


class Bases:
    """The base tensors of one model, by key, as the prepare step collects them: a name seen
    twice with two values gets a second key (``name@2``)."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}

    def add(self, name: str, value: np.ndarray) -> str:
        key, k = name, 1
        while key in self.values:
            old = self.values[key]
            if old.shape == value.shape and old.dtype == value.dtype and np.array_equal(
                    old, value, equal_nan=value.dtype.kind == "f"):
                return key
            k += 1
            key = f"{name}@{k}"
        # (np.ascontiguousarray would make a 0-d weight 1-d)
        self.values[key] = value if value.flags["C_CONTIGUOUS"] else value.copy(order="C")
        return key

    def resolve(self, params: dict[str, np.ndarray]) -> dict[str, list]:
        """How to make each of ``params``: ``[base key, None]`` or ``[base key, [layout,
        lanes]]``; packed weights are traced to the unpacked tensor of the same name where
        another build holds it (``add`` it first), or unpacked here."""
        out = {}
        for name, value in params.items():
            how = packed_name(name)
            if how is not None:
                base, layout, lanes = how
                pack, unpack = PACKS[layout]
                for key in [k for k in self.values if k == base or k.startswith(base + "@")]:
                    src = self.values[key]
                    if _packs_to(pack, src, lanes, value):
                        out[name] = [key, [layout, lanes]]
                        break
                else:
                    src = unpack(value, lanes)
                    if _packs_to(pack, src, lanes, value):
                        out[name] = [self.add(base, src), [layout, lanes]]
                if name in out:
                    continue
            out[name] = [self.add(name, value), None]
        return out


def _packs_to(pack: Callable, src: np.ndarray, lanes: int, want: np.ndarray) -> bool:
    try:
        got = pack(src, lanes)
    except ValueError:  # another rank or a shape the layout cannot take
        return False
    return got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


def travels(value: np.ndarray) -> bool:
    """Whether a base tensor goes into the bundle as it is (else a recipe)."""
    if value.dtype.kind != "f" or value.nbytes <= TRAVEL_BYTES:
        return True
    flat = value.reshape(-1)
    sample = flat[:: max(1, flat.size // 65536)]
    if not bool(np.all(np.isfinite(sample))) or not bool(np.all(np.isfinite(value))):
        return True
    distinct = len(np.unique(sample))
    return distinct <= FEW_VALUES or (distinct <= TABLE_VALUES
                                      and distinct * TABLE_REPEATS <= sample.size)


def recipes(model: str, bases: dict[str, np.ndarray], onnx: dict[str, np.ndarray] | None = None
            ) -> tuple[dict, dict[str, np.ndarray]]:
    """``(recipes, arrays)``: a recipe per base that does not travel (JSON), and the arrays
    that do (the bases that travel, and the row statistics of the others) for ``small.npz``.
    With ``onnx`` (the initializers of an ONNX file that travels), a base equal to one of
    them is read from that file, and every other base travels: the weights stay the file's."""
    table, arrays = {}, {}
    for key, value in bases.items():
        if onnx is not None:
            same = [n for n, v in onnx.items() if v.shape == value.shape
                    and v.dtype == value.dtype and np.array_equal(v, value)]
            table[key] = {"onnx": sorted(same, key=lambda n: n != key)[0]} if same else \
                {"travels": True}
            if not same:
                arrays[f"base/{key}"] = value
            continue
        if travels(value):
            arrays[f"base/{key}"] = value
            table[key] = {"travels": True}
            continue
        x = value.astype(np.float64)
        rows = value.ndim >= 2 and value.shape[0] <= ROW_STATS_MAX
        axes = tuple(range(1, value.ndim)) if rows else None
        mean = np.mean(x, axis=axes).astype(np.float32)
        std = np.std(x, axis=axes).astype(np.float32)
        arrays[f"mean/{key}"], arrays[f"std/{key}"] = mean, std
        table[key] = {"shape": list(value.shape), "dtype": str(value.dtype),
                      "seed": seed_of(model, key), "rows": rows}
    return table, arrays


def regenerate(table: dict, arrays: dict[str, np.ndarray],
               onnx: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every base tensor of a model: those that travel from ``arrays`` (or ``onnx``, the
    initializers of the model's ONNX file), the others made by their recipe (the same numbers
    on every machine: numpy's PCG64 stream of the seed)."""
    out = {}
    for key, r in table.items():
        if "onnx" in r:
            out[key] = onnx[r["onnx"]]
            continue
        if r.get("travels"):
            out[key] = arrays[f"base/{key}"]
            continue
        shape = tuple(r["shape"])
        x = np.random.default_rng(r["seed"]).standard_normal(shape, dtype=np.float32)
        mean, std = arrays[f"mean/{key}"], arrays[f"std/{key}"]
        if r["rows"]:
            mean = mean.reshape((-1,) + (1,) * (len(shape) - 1))
            std = std.reshape(mean.shape)
        x *= std
        x += mean
        out[key] = x.astype(r["dtype"], copy=False)
    return out


def params_of(how: dict[str, list], bases: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One build's weights from the base tensors (``Bases.resolve``'s table)."""
    out = {}
    for name, (key, layout) in how.items():
        value = bases[key]
        out[name] = value if layout is None else PACKS[layout[0]][0](value, int(layout[1]))
    return out


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
