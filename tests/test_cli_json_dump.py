"""The CLI's indented JSON writer must match json.dumps(indent=1) byte for byte."""
import json
import math

import pytest

from estimator.cli import dumps_indent1


def test_dumps_indent1_matches_json():
    doc = {"a": [], "b": {}, "c": [1, 2.5, -0.0, 1e300, 1e-7, True, False, None],
           "d": {"x": {"y": [[], [{}], (1, "two")]}}, "é\"\\\n": "ü\x01", 3: "int key", 2.5: "float key",
           True: "bool key", None: "none key", "big": 2 ** 80, "nested": [[[1]]], "s": "plain"}
    assert dumps_indent1(doc) == json.dumps(doc, indent=1, allow_nan=False)
    for v in ([], {}, 0, "x", None, 1.5):
        assert dumps_indent1(v) == json.dumps(v, indent=1)


def test_dumps_indent1_is_strict_json():
    """NaN and Infinity are not JSON: refused, as json.dumps(allow_nan=False) refuses them, nested or not."""
    for bad in (math.nan, math.inf, -math.inf):
        for doc in (bad, [1, bad], {"x": {"y": bad}}, {bad: 1}):
            with pytest.raises(ValueError) as ours:
                dumps_indent1(doc)
            with pytest.raises(ValueError) as theirs:
                json.dumps(doc, indent=1, allow_nan=False)
            assert "not JSON compliant" in str(ours.value) and "not JSON compliant" in str(theirs.value)
