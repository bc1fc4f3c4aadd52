"""Placement rules that name no op: an error, not a placement that silently does nothing."""

import pytest

import hgrt
from hgrt.testing import conv_model


@pytest.mark.parametrize("key, hint", [("Conv", None), ("conv2d", "nn.conv2d"),
                                       ("nn.cnv2d", "nn.conv2d")])
def test_a_rule_that_names_no_relax_op_is_refused(key, hint):
    """``--place Conv=cpu:1`` (ONNX's name) put nothing on cpu:1 without a word."""
    with pytest.raises(hgrt.BuildError, match=f"placement rule '{key}' names no Relax op") as e:
        hgrt.build(conv_model(), ["cpu:0", "cpu:1"],
                   placement=hgrt.Placement(rules={key: "cpu:1"}))
    assert "this model's ops: [" in str(e.value) and "'nn.conv2d'" in str(e.value)
    if hint:
        assert f"did you mean '{hint}'" in str(e.value)


@pytest.mark.parametrize("key", ["nn.conv2d", "relax.nn.relu", "nn.*pool*", "nn.dense_x*",
                                 "nn.softmax"])
def test_op_names_patterns_and_ops_this_model_lacks_are_fine(key):
    hgrt.build(conv_model(), ["cpu:0", "cpu:1"], placement=hgrt.Placement(rules={key: "cpu:1"}))
