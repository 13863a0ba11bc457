"""estimator.jsonload reads JSON exactly as json.loads does (values and errors) without importing json on success."""
import json
import math

import pytest

from estimator import jsonload

CASES = [
    '{"a": [1, 2.5, -3e-7, true, false, null], "b": {"c": "\\u00e9\\n"}}',
    "  \n[1, 2]\t\r\n",
    '"just a string"',
    "12345678901234567890123",
    "[NaN, Infinity, -Infinity]",
    '{"dup": 1, "dup": 2}',
    "[]",
    "{}",
]


@pytest.mark.parametrize("text", CASES)
def test_same_values_as_json(text):
    got, want = jsonload.loads(text), json.loads(text)
    assert json.dumps(got) == json.dumps(want)
    assert type(got) is type(want)


def test_constants_are_floats():
    nan, inf, ninf = jsonload.loads("[NaN, Infinity, -Infinity]")
    assert math.isnan(nan) and inf == math.inf and ninf == -math.inf


@pytest.mark.parametrize("text", ["", "   ", "[1, 2", '{"a": 1} x', "[1,]", "\ufeff[1]", "{'a': 1}", '["\x01"]'])
def test_errors_are_jsons(text):
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        jsonload.loads(text)
    assert str(got.value) == str(want.value)


def test_encode_string_matches_json():
    for s in ["plain", "quote \" backslash \\ tab \t", "é ü 漢 \U0001f600", "\x00\x1f"]:
        assert jsonload.encode_string(s) == json.dumps(s)
