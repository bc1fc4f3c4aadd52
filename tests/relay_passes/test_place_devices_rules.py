"""Placement settings that cannot mean anything: an error that says what is wrong (a rule
naming no op, a placement of the wrong shape, a vdevice the device list lacks), not a placement
that silently does nothing or a raw AttributeError."""

import pytest

import hgrt
from hgrt.testing import conv_model, user_placed


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


def test_a_placement_given_as_a_dict_of_its_fields_is_taken():
    res = hgrt.build(conv_model(), ["cpu:0", "cpu:1"], {"rules": {"nn.conv2d": "cpu:1"}})
    assert [r.device for r in res.placement_report if r.op == "relax.nn.conv2d"] == ["cpu:1"]
    # what the settings took before they were checked: None for none, bytes as a float, 1
    p = hgrt.Placement(rules=None, overrides=None, budgets={"cpu:1": 2e9}, auto=1)
    assert p.rules == p.overrides == {} and p.budgets == {"cpu:1": 2e9}


@pytest.mark.parametrize("placement, match", [
    ({"rule": {}}, r"placement field 'rule' not found; did you mean 'rules'\?"),
    ("cpu:1", r"placement must be an hgrt.Placement or a dict of its fields \['rules', "),
    (["cpu:1"], r"or a dict of its fields .* got list"),
    ({"rules": "nn.conv2d"}, r"Placement.rules must be a dict \(op name or pattern -> device"),
    ({"overrides": ["lv"]}, r"Placement.overrides must be a dict .* got list"),
    ({"budgets": {"cpu:0": "lots"}, "auto": True},
     r"Placement.budgets\['cpu:0'\] must be bytes \(a number >= 0\), got 'lots'"),
    ({"budgets": {"cpu:0": -1}}, r"must be bytes"),
    ({"auto": "yes"}, r"Placement.auto must be True or False, got 'yes'"),
    ({"profile": 3}, r"Placement.profile must be a path"),
])
def test_a_placement_of_the_wrong_shape_says_what_is_wrong(placement, match):
    # raw "'dict' object has no attribute 'rules'" or int() errors before
    with pytest.raises(hgrt.BuildError, match=match):
        hgrt.build(conv_model(), ["cpu:0", "cpu:1"], placement)


@pytest.mark.parametrize("devices, missing", [(["cpu:0", "cpu:1"], "cpu:2"),
                                              (["cpu:0", "cpu:2"], "cpu:1")])
def test_a_vdevice_of_the_module_the_device_list_lacks_is_named(devices, missing):
    """A Relax module placed over cpu:0..2 by its author, built for two of them: which one its
    third vdevice means cannot be told (insert_copies said 'not supported by hgrt' before)."""
    mod, params = user_placed(conv_model(), 3)
    with pytest.raises(hgrt.BuildError, match=rf"vdevice llvm:{missing[-1]} .* the build has no "
                                              rf"{missing} \(its cpu devices: "):
        hgrt.build(mod, devices, params=params)
