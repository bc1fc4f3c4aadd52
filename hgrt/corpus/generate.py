"""Write the corpus: every model's tiny config exported by both exporters into a directory,
with ``manifest.json``; the real configs exported too (into a cache) for their op types.

    python -m hgrt.corpus.generate tests/data/corpus            # everything
    python -m hgrt.corpus.generate tests/data/corpus --models gpt2 lstm

Needs the ``corpus`` extra (``pip install 'hgrt[corpus]'``). Deterministic: the same versions
of torch, transformers and onnxscript write the same op types.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from hgrt.corpus.manifest import MANIFEST
from hgrt.corpus.specs import ALL, BY_NAME, EXPORTERS, HELD_OUT, inputs_of


def cache_dir() -> str:
    """Where real-config exports go: ``$HGRT_CORPUS_CACHE``, else ``~/.cache/hgrt/corpus``."""
    return os.environ.get("HGRT_CORPUS_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hgrt", "corpus")


def real_path(name: str, exporter: str, export_missing: bool = True, batch: int = 1) -> str:
    """The real config of ``name`` exported by ``exporter`` with inputs of ``batch`` samples,
    from the cache (exported first when missing and ``export_missing``)."""
    from hgrt.corpus.export import export

    tail = "" if batch == 1 else f".batch{batch}"
    path = os.path.join(cache_dir(), f"{name}.{exporter}{tail}.onnx")
    if not os.path.exists(path) and export_missing:
        os.makedirs(cache_dir(), exist_ok=True)
        export(name, "real", exporter, path + ".tmp", batch)
        os.replace(path + ".tmp", path)
    return path


def _versions() -> dict:
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnxscript": onnxscript.__version__, "onnxruntime": onnxruntime.__version__}


def entry_for(name: str, exporter: str, directory: str, real: bool) -> dict:
    """Export ``name``'s tiny config with ``exporter`` into ``directory`` and describe it."""
    from hgrt.corpus.export import describe, export, op_types

    s = BY_NAME[name]
    file = f"{name}.{exporter}.onnx"
    export(name, "tiny", exporter, os.path.join(directory, file))
    d = describe(os.path.join(directory, file))
    highs = {n: high for n, _, _, high in inputs_of(s, "tiny")}
    for i in d["inputs"]:
        i["high"] = highs.get(i["name"], 0)
    real_ops = op_types(real_path(name, exporter)) if real else None
    return {"name": f"{name}.{exporter}", "model": name, "exporter": exporter,
            "family": s.family, "held_out": name in HELD_OUT, "file": file,
            "quantized_from": s.quantize, **d, "real_op_types": real_ops}


def generate(directory: str, names: list[str], real: bool = True) -> dict:
    """Export ``names`` (tiny into ``directory``, real into the cache) and update the
    manifest there; entries of other models are kept."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MANIFEST)
    old = json.load(open(path)) if os.path.exists(path) else {"entries": []}
    kept = {e["name"]: e for e in old["entries"]}
    for name in names:
        for exporter in EXPORTERS:
            t0 = time.perf_counter()
            e = entry_for(name, exporter, directory, real)
            if e["real_op_types"] is None:  # not re-exported: keep what the last run measured
                e["real_op_types"] = kept.get(e["name"], {}).get("real_op_types")
            kept[e["name"]] = e
            _write(path, kept)  # after each file: a long run stopped keeps what it did
            print(f"{e['name']}: {e['bytes'] / 1024:.0f} KiB, {e['nodes']} nodes, opset "
                  f"{e['opset']}, {time.perf_counter() - t0:.1f} s", flush=True)
    return json.load(open(path))


def _write(path: str, kept: dict) -> None:
    order = [f"{s.name}.{x}" for s in ALL for x in EXPORTERS]
    manifest = {"versions": _versions(), "entries": [kept[n] for n in order if n in kept]}
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="where the tiny files and manifest.json go")
    p.add_argument("--models", nargs="*", default=[s.name for s in ALL])
    p.add_argument("--no-real", action="store_true",
                   help="skip the real configs (their op types stay as the manifest has them)")
    args = p.parse_args(argv)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's advice
    generate(args.directory, args.models, real=not args.no_real)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
