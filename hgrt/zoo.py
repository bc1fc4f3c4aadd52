"""Real models to try hgrt on without a download: the "light" zoo models of the onnx wheel.

The wheel ships squeezenet, resnet50, vgg19 … as ``light_<name>.onnx`` whose weights are
``ConstantOfShape`` placeholders. ``light_model`` replaces each one by a seeded random
initializer (normal, scaled by 1/sqrt(fan-in) so activations stay finite through the network;
1-D tensors such as biases and batch-norm variances positive), so the model runs and gives
the same numbers every time. The architecture, shapes and op mix are the real model's.

    hgrt zoo squeezenet -o squeezenet.onnx

The corpus of today's architectures (``hgrt.corpus``) is here too, as ``corpus/<file>``: the
committed tiny export, or the real config exported on demand (the ``corpus`` extra).

    hgrt zoo --list
    hgrt zoo corpus/gpt2.dynamo -o gpt2.onnx
    hgrt zoo corpus/gpt2.dynamo --size real -o gpt2-real.onnx
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["CORPUS_PREFIX", "LIGHT_MODELS", "light_input", "light_model", "light_path",
           "zoo_listing", "zoo_write"]

CORPUS_PREFIX = "corpus/"

LIGHT_MODELS = ("squeezenet", "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2",
                "resnet50", "shufflenet", "vgg19", "zfnet512")


def light_path(name: str) -> str:
    """Where the onnx wheel keeps ``light_<name>.onnx``."""
    import onnx

    from hgrt.errors import InputError, did_you_mean

    if name not in LIGHT_MODELS:
        raise InputError(f"light model {did_you_mean(name, LIGHT_MODELS)}")
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                        f"light_{name}.onnx")


def light_model(name: str, seed: int = 0):
    """``light_<name>.onnx`` as a ModelProto with seeded random weights (see module doc)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(light_path(name))
    rng = np.random.default_rng(seed)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    kept, new_inits = [], []
    for node in model.graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = tuple(int(d) for d in inits[node.input[0]])
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
            if len(shape) == 1:  # biases, batch-norm vectors: keep variances positive
                value = np.abs(value) + 0.5
            new_inits.append(numpy_helper.from_array(value.astype("float32"), node.output[0]))
        else:
            kept.append(node)
    used = {i for n in kept for i in n.input}
    graph = model.graph
    del graph.node[:]
    graph.node.extend(kept)
    old = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(old + new_inits)
    names = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in names and i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    return model


def light_input(model, seed: int = 1) -> dict[str, np.ndarray]:
    """Seeded standard-normal values for every graph input of ``model``."""
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
            .astype("float32") for i in model.graph.input}


def zoo_listing() -> list[str]:
    """One line per model ``hgrt zoo`` can write: the light models, then the corpus files
    (family, held out of tuning or not, op count)."""
    from hgrt.corpus import entries

    lines = [f"{name:28s} light zoo (onnx wheel), random weights" for name in LIGHT_MODELS]
    for e in entries():
        held = ", held out" if e.held_out else ""
        lines.append(f"{CORPUS_PREFIX + e.name:28s} {e.family}{held}, opset {e.opset}, "
                     f"{len(e.op_types)} op types")
    return lines


def zoo_write(name: str, output: str, size: str = "tiny", seed: int = 0
              ) -> tuple[str, dict[str, np.ndarray]]:
    """Write zoo model ``name`` (a light model, or ``corpus/<file>``) to ``output``: (what was
    written, its seeded inputs). A corpus file at ``size="real"`` is its real config, exported
    into the corpus cache first (needs the ``corpus`` extra)."""
    import shutil

    import onnx

    from hgrt.errors import InputError

    if not name.startswith(CORPUS_PREFIX):
        if size != "tiny":
            raise InputError(f"--size {size}: light zoo models come in one size")
        model = light_model(name, seed=seed)
        onnx.save(model, output)
        return f"light {name} with random weights (seed {seed})", light_input(model, seed + 1)
    from hgrt.corpus import entry, seeded_inputs
    from hgrt.corpus.specs import inputs_of, spec

    e = entry(name[len(CORPUS_PREFIX):])
    if size == "tiny":
        shutil.copyfile(e.path, output)
        return f"corpus {e.name} (tiny config)", e.seeded_inputs(seed + 1)
    if size != "real":
        raise InputError(f"--size {size!r}: tiny or real")
    from hgrt.corpus.generate import real_path

    shutil.copyfile(real_path(e.model, e.exporter), output)
    return (f"corpus {e.name} (real config)",
            seeded_inputs(inputs_of(spec(e.model), "real"), seed + 1))
