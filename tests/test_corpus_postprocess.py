"""The post-processing model of the corpus: its convolutions where they pay, its TopK and CumSum
(no CUDA kernel in hgrt's GPU build) on the CPU, and right against onnxruntime."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

import hgrt
from hgrt.corpus.postprocess import K, postprocess_model
from hgrt.graph import COPY_FUNC
from hgrt.testing import assert_close_to, reference, run_hgrt

POST = ("relax.topk", "relax.cumsum")


@pytest.fixture(scope="module")
def model():
    return postprocess_model()


def build(model, devices, placement):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return hgrt.build(model, devices, placement)


def test_the_outputs_are_informative(model):
    proto, inputs = model
    scores, classes, cumulative, rows = reference(proto, inputs)
    assert scores.shape == classes.shape == (1, K) and rows.shape[:2] == (1, K)
    assert np.all(np.diff(scores) < -1e-3)  # no near-ties that rounding could reorder
    assert 0.2 < cumulative[0, -1] < 0.99  # the probability is spread, not all on one class


def test_auto_sends_convolutions_to_the_gpu_and_post_processing_to_the_cpu(model, caplog):
    with caplog.at_level(logging.DEBUG, logger="hgrt.build"):
        res = build(model[0], ["cpu:0", "cuda:0"], hgrt.Placement(auto=True))
    rows = res.placement_report
    convs = [r for r in rows if r.op == "relax.nn.conv2d"]
    post = [r for r in rows if r.op in POST]
    assert len(convs) == 2 and all(r.device == "cuda:0" for r in convs)
    assert len(post) == 2 and all(r.device == "cpu:0" for r in post)
    assert 1 <= sum(n.func_name == COPY_FUNC for n in res.graph.nodes) <= 2
    assert "-> split" in caplog.text


def test_split_over_two_cpus_runs_right(model):
    proto, inputs = model
    res = build(proto, ["cpu:0", "cpu:1"], hgrt.Placement(rules={"nn.conv2d": "cpu:1"}))
    where = {r.op: r.device for r in res.placement_report}
    assert where["relax.nn.conv2d"] == "cpu:1" and all(where[op] == "cpu:0" for op in POST)
    assert any(n.func_name == COPY_FUNC for n in res.graph.nodes)
    assert_close_to(run_hgrt(res, inputs), reference(proto, inputs))
