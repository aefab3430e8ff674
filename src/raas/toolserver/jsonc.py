"""JSON through the C accelerator ``_json`` directly: the :mod:`json` package imports :mod:`re` (and with
it :mod:`enum`) for its pure-Python paths, which costs more CPU than the rest of the tool server's
start-up. Same results as ``json.loads`` / ``json.dumps(obj, separators=(",", ":"))``; where ``_json``
lacks what is needed, the :mod:`json` package is used."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

_WHITESPACE = " \t\n\r"


class _Context:
    """What ``_json.make_scanner`` reads from a ``json.JSONDecoder`` (the defaults)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
    memo: dict = {}


def _not_serializable(obj: Any) -> Any:
    raise TypeError("Object of type %s is not JSON serializable" % type(obj).__name__)


_scan: Optional[Callable[[str, int], Any]] = None
_make_encoder: Any = None
_quote: dict = {}

try:
    import _json

    _scan = _json.make_scanner(_Context())  # type: ignore[arg-type]
    _make_encoder = _json.make_encoder
    _quote = {False: _json.encode_basestring, True: _json.encode_basestring_ascii}
except (ImportError, AttributeError, TypeError):
    _scan = _make_encoder = None


def loads(text: str) -> Any:
    """``json.loads(text)`` for a str; raises ValueError on anything but one JSON value."""
    if _scan is None:
        import json

        return json.loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        obj, end = _scan(text, start)
    except StopIteration as exc:
        raise ValueError("Expecting value: char %d" % exc.value) from None
    except SystemError:
        # CPython 3.11's scanner raises its JSONDecodeError only when ``json.decoder`` is already in
        # sys.modules (it looks the class up there, never imports it); otherwise a malformed body is a
        # SystemError. Malformed input is rare: let the json package word the error.
        import json

        return json.loads(text)
    if end != len(text) and text[end:].strip(_WHITESPACE):
        raise ValueError("Extra data: char %d" % end)
    return obj


def dumps(obj: Any, ensure_ascii: bool) -> str:
    """``json.dumps(obj, ensure_ascii=..., separators=(",", ":"))``; TypeError/ValueError as there."""
    if _make_encoder is None:
        import json

        return json.dumps(obj, ensure_ascii=ensure_ascii, separators=(",", ":"))
    # A fresh encoder per call, as json.dumps does: its circular-reference markers must start empty.
    encode = _make_encoder({}, _not_serializable, _quote[ensure_ascii], None, ":", ",", False, False, True)
    return "".join(encode(obj, 0))
