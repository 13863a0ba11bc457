"""The CLI's indented JSON writer must match json.dumps(indent=1) byte for byte."""
import json
import math

from estimator.cli import dumps_indent1


def test_dumps_indent1_matches_json():
    doc = {"a": [], "b": {}, "c": [1, 2.5, -0.0, 1e300, 1e-7, math.inf, -math.inf, math.nan, True, False, None],
           "d": {"x": {"y": [[], [{}], (1, "two")]}}, "é\"\\\n": "ü\x01", 3: "int key", 2.5: "float key",
           True: "bool key", None: "none key", "big": 2 ** 80, "nested": [[[1]]], "s": "plain"}
    assert dumps_indent1(doc) == json.dumps(doc, indent=1)
    for v in ([], {}, 0, "x", None, 1.5):
        assert dumps_indent1(v) == json.dumps(v, indent=1)
