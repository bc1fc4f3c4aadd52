"""The corpus (``hgrt.corpus``): every committed tiny model builds and matches onnxruntime on its
ONNX file, all on cpu:0 and split over cpu:0 / cpu:1 by rules; int8 QDQ models stay within
twice onnxruntime's own spread (its int8 kernels against its QDQ-as-float run) with the same
top-1; each tiny file has the op types of its real config. No torch needed: the files are
committed (``python -m hgrt.corpus.generate tests/data/corpus`` writes them).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest

import hgrt
from hgrt.corpus import ALL, EXPORTERS, HELD_OUT, entries
from hgrt.testing import assert_close_to, input_names, onnx_reference, run_hgrt

ENTRIES = {e.name: e for e in entries()}
# convolutions, dense layers and matmuls on cpu:1, the rest on cpu:0
SPLIT = {"rules": {"nn.*": "cpu:1", "matmul": "cpu:1"}}
PLACEMENTS = {"single": (["cpu:0"], None), "split": (["cpu:0", "cpu:1"], SPLIT)}
MAX_BYTES = 2 * 1024 * 1024

# what does not build yet, by file: the error it raises
FAILING: dict[str, str] = {}
# what the default run builds (both placements): one or two of each family; -m slow: the rest
DEFAULT = {"distilbert.dynamo", "gpt2.dynamo", "t5_encoder.torchscript", "resnet.torchscript",
           "lstm.dynamo", "gru.torchscript", "resnet_int8.torchscript"}


def _params(names, placements=("single", "split")):
    out = []
    for name in names:
        marks = [] if name in DEFAULT else [pytest.mark.slow]
        if name in FAILING:
            marks.append(pytest.mark.xfail(reason=FAILING[name], strict=True))
        out += [pytest.param(name, p, marks=marks, id=f"{name}-{p}") for p in placements]
    return out


FLOAT = [n for n, e in ENTRIES.items() if e.family != "int8"]
INT8 = [n for n, e in ENTRIES.items() if e.family == "int8"]


def test_the_manifest_holds_every_model_by_both_exporters():
    want = {f"{s.name}.{x}" for s in ALL for x in EXPORTERS}
    assert set(ENTRIES) == want
    assert len({e.model for e in ENTRIES.values() if e.family != "int8"}) >= 20
    assert {e.model for e in ENTRIES.values() if e.held_out} == set(HELD_OUT)
    for e in ENTRIES.values():
        assert os.path.getsize(e.path) < MAX_BYTES, e.name


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_the_tiny_file_has_the_real_configs_op_types(name):
    """The tiny config exercises every op type of the real one (the manifest holds what the real
    config's export gave; the file is read again here)."""
    from hgrt.corpus.export import op_types

    e = ENTRIES[name]
    if not e.real_op_types:
        pytest.skip("the real config was not exported when the manifest was written "
                    "(python -m hgrt.corpus.generate tests/data/corpus --models "
                    f"{e.model})")
    assert op_types(onnx.load(e.path)) == list(e.real_op_types)


def _run(name: str, placement: str):
    e = ENTRIES[name]
    model = onnx.load(e.path)
    x = e.seeded_inputs()
    devices, rules = PLACEMENTS[placement]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = hgrt.build(model, devices, rules)
    if placement == "split":  # the rules did split it
        assert {r.device for r in res.placement_report} == {"cpu:0", "cpu:1"}
    got = run_hgrt(res, dict(zip(input_names(model), x.values(), strict=True)))
    return model, x, got


@pytest.mark.parametrize(("name", "placement"), _params(FLOAT))
def test_corpus_model_matches_onnxruntime(name, placement):
    model, x, got = _run(name, placement)
    assert_close_to(got, onnx_reference(model, x), rtol=1e-4, atol_of_max=1e-4)


def _ort_int8(model, x):
    """onnxruntime with its graph optimizations, which run QDQ groups as int8 kernels."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, x)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize(("name", "placement"), _params(INT8))
def test_int8_model_within_twice_onnxruntimes_own_spread(name, placement):
    pytest.importorskip("onnxruntime")
    model, x, got = _run(name, placement)
    as_float = onnx_reference(model, x)  # QDQ as float: no graph optimization
    int8 = _ort_int8(model, x)
    for g, f, q in zip(got, as_float, int8, strict=True):
        spread = _rel(q, f)
        assert _rel(g, f) <= max(2 * spread, 1e-6), (_rel(g, f), spread)
        np.testing.assert_array_equal(g.argmax(-1), f.argmax(-1))  # top-1


def test_hgrt_zoo_lists_and_writes_corpus_files(tmp_path, capsys):
    from hgrt.cli import main

    assert main(["zoo", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "squeezenet" in listing and "corpus/gru.torchscript" in listing
    out, feed = tmp_path / "gru.onnx", tmp_path / "gru.npz"
    assert main(["zoo", "corpus/gru.torchscript", "-o", str(out), "--input", str(feed)]) == 0
    assert out.read_bytes() == open(ENTRIES["gru.torchscript"].path, "rb").read()
    assert sorted(np.load(feed)) == ["h0", "x"]
    assert main(["zoo", "corpus/gruu", "-o", str(out)]) == 2
    assert "did you mean 'gru.dynamo'" in capsys.readouterr().err


def test_inputs_at_a_batch_scale_the_batch_axis_only():
    from hgrt.corpus import spec
    from hgrt.corpus.specs import inputs_of

    for name in ("lstm", "distilbert", "resnet_int8"):
        one, eight = inputs_of(spec(name), "real"), inputs_of(spec(name), "real", 8)
        assert [n for n, *_ in one] == [n for n, *_ in eight]
        for (n, shape, dtype, high), (_, shape8, dtype8, high8) in zip(one, eight, strict=True):
            axis = 1 if n == "h0" else 0
            assert shape8[axis] == 8 * shape[axis], (name, n)
            assert shape8[:axis] + shape8[axis + 1:] == shape[:axis] + shape[axis + 1:]
            assert (dtype8, high8) == (dtype, high)
