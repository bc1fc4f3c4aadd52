"""The committed corpus: tiny ONNX files and ``manifest.json`` beside them (no torch needed).

Each entry is one file, ``<model>.<exporter>.onnx``: its inputs (name, shape, dtype and, for
integer ids, their bound), outputs, opset, the op types of the file and of the real config's
export by the same exporter, its family, and whether it is held out of tuning loops.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

MANIFEST = "manifest.json"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Entry:
    """One committed corpus file (``name`` = ``<model>.<exporter>``)."""

    name: str
    model: str
    exporter: str
    family: str
    held_out: bool
    path: str
    inputs: tuple  # (name, shape, dtype, high) per graph input
    op_types: tuple
    real_op_types: tuple  # empty where the real config was not exported
    opset: int

    def seeded_inputs(self, seed: int = 1) -> dict[str, np.ndarray]:
        """The corpus's inputs for this file: standard-normal floats, integer ids below their
        bound, seeded."""
        return seeded_inputs(self.inputs, seed)


def seeded_inputs(inputs, seed: int = 1) -> dict[str, np.ndarray]:
    """Values for ``inputs`` ((name, shape, dtype, high) each): standard-normal floats, integer
    ids uniform in [0, high)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, dtype, high in inputs:
        if np.dtype(dtype).kind in "iu":
            out[name] = rng.integers(0, high, shape).astype(dtype)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def corpus_dir() -> str:
    """Where the committed corpus lives: ``$HGRT_CORPUS_DIR``, else ``tests/data/corpus`` of
    the source tree hgrt runs from."""
    return os.environ.get("HGRT_CORPUS_DIR") or os.path.join(_REPO, "tests", "data", "corpus")


def read_manifest(directory: str | None = None) -> dict:
    from hgrt.errors import InputError

    path = os.path.join(directory or corpus_dir(), MANIFEST)
    if not os.path.exists(path):
        raise InputError(f"no corpus manifest at {path} (set HGRT_CORPUS_DIR, or write the "
                         f"corpus with `python -m hgrt.corpus.generate DIR`)")
    with open(path) as f:
        return json.load(f)


def entries(directory: str | None = None) -> list[Entry]:
    """Every committed corpus file, in manifest order."""
    directory = directory or corpus_dir()
    out = []
    for e in read_manifest(directory)["entries"]:
        out.append(Entry(e["name"], e["model"], e["exporter"], e["family"], e["held_out"],
                         os.path.join(directory, e["file"]),
                         tuple((i["name"], tuple(i["shape"]), i["dtype"], i.get("high", 0))
                               for i in e["inputs"]),
                         tuple(e["op_types"]), tuple(e["real_op_types"] or ()), e["opset"]))
    return out


def entry(name: str, directory: str | None = None) -> Entry:
    """The corpus file ``name`` (``<model>.<exporter>``; a bare model name means its dynamo
    export)."""
    from hgrt.errors import InputError, did_you_mean

    found = {e.name: e for e in entries(directory)}
    key = name if name in found or "." in name else f"{name}.dynamo"
    if key not in found:
        raise InputError(f"corpus file {did_you_mean(key, list(found))}")
    return found[key]
