"""JSON in and out without importing the `json` package on the success path.

`import json` pulls in `re`, `enum` and `functools` (about 12 ms of a ~70 ms CLI run on the CI machine) only to
skip whitespace with a regex; the parsing itself is done by CPython's C accelerator `_json`, which this module
calls directly. Anything unusual (no `_json`, a syntax error, a BOM, trailing data) is handed to `json.loads`,
so results and error messages are exactly json's.
"""
from __future__ import annotations

try:
    from _json import encode_basestring_ascii, make_scanner as _make_scanner
except ImportError:  # another Python implementation: the json package does everything
    encode_basestring_ascii = None
    _make_scanner = None

_WS = " \t\n\r"
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Context:
    """The attributes json.JSONDecoder gives its scanner, at json.loads's defaults."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


_scan = _make_scanner(_Context()) if _make_scanner else None


def loads(text: str):
    """json.loads(text) for a str (bad input raises json.JSONDecodeError, a ValueError)."""
    if _scan is not None:
        start = len(text) - len(text.lstrip(_WS))
        try:
            obj, end = _scan(text, start)
        except Exception:  # StopIteration (no value), or a decode error: json says which, in its words
            obj, end = None, -1
        if end >= 0 and not text[end:].strip(_WS):
            return obj
    import json
    return json.loads(text)


def load(fh):
    """json.load(fh) for a text file."""
    return loads(fh.read())


def encode_string(s: str) -> str:
    """json's ASCII string literal for s (what json.dumps writes for a str)."""
    if encode_basestring_ascii is not None:
        return encode_basestring_ascii(s)
    from json.encoder import encode_basestring_ascii as enc
    return enc(s)
