"""What the hostile-input fuzzers share: value strategies, the property every answer must hold, and the
tally of inputs tried that docs/reliability.md reports."""

from __future__ import annotations

import collections
import copy
import json
from typing import Any

import httpx
from hypothesis import strategies as st

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
NUMBER = st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True) | JSON
# text a form or a header might carry: control characters, NUL, lone surrogates escaped, long runs, HTML
TEXT = (st.text(max_size=40) | st.text(st.characters(max_codepoint=0x1f), max_size=10)
        | st.sampled_from(["", " ", "0", "-1", "1e309", "NaN", "9" * 400, "<script>alert(1)</script>",
                           "../../etc/passwd", "' OR 1=1 --", "%00", "\u202e", "a" * 5000, "//evil.example",
                           "\\\\evil", "/admin?x=<>"]))
FORM_VALUE = TEXT | st.integers().map(str) | st.floats(allow_nan=True).map(str)


class Tally:
    """Inputs tried and statuses seen, per endpoint (printed as the FIGURES line of a module)."""

    def __init__(self) -> None:
        self.tried: collections.Counter[str] = collections.Counter()
        self.statuses: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)

    def count(self, where: str, status: int) -> None:
        self.tried[where] += 1
        self.statuses[where][status] += 1

    def num(self, where: str, status: int) -> int:
        return self.statuses[where][status]

    def __str__(self) -> str:
        return " ".join(f"{where}={n}{dict(sorted(self.statuses[where].items()))}"
                        for where, n in sorted(self.tried.items()))


def check(resp: httpx.Response, tally: Tally | None = None, where: str = "", json_errors: bool = False
          ) -> httpx.Response:
    """No 5xx, no traceback; a JSON error is an OpenAI error body with exactly message, type, param, code
    (``json_errors``: every error is one, as on the OpenAI API; pages answer a form's error with HTML)."""
    if tally is not None:
        tally.count(where or resp.request.url.path, resp.status_code)
    assert resp.status_code < 500, (resp.request.method, str(resp.request.url)[:200], resp.status_code,
                                    resp.text[:500])
    assert "Traceback" not in resp.text
    is_json = resp.headers.get("Content-Type", "").startswith("application/json")
    if resp.status_code >= 400 and (is_json or json_errors):
        assert is_openai_error(resp.json()), resp.text[:500]
    if resp.status_code in (301, 302, 303, 307, 308):  # never an open redirect
        location = resp.headers["Location"]
        assert location.startswith("/") and not location.startswith("//") and "\\" not in location, location
    return resp


def is_openai_error(body: Any) -> bool:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return False
    err = body["error"]
    return set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) \
        and isinstance(err["type"], str) and (err["code"] is None or isinstance(err["code"], str))


# How a JSON endpoint's cases are drawn: mostly a valid body with one field changed, so validation passes often.
BODY_MODES = st.sampled_from(["one hostile field"] * 3 + ["any JSON", "raw bytes"])


def hostile_json(data: st.DataObject, mode: str, valid: dict[str, Any], fields: st.SearchStrategy[str],
                 values: st.SearchStrategy[Any], max_raw: int = 300) -> bytes:
    """A request body for ``mode`` (see :data:`BODY_MODES`): ``valid`` with one of ``fields`` set to one of
    ``values``, any JSON document, or raw bytes."""
    if mode == "one hostile field":
        body = copy.deepcopy(valid)
        body[data.draw(fields | st.text(max_size=10))] = data.draw(values)
        return json.dumps(body, allow_nan=True).encode()
    if mode == "any JSON":
        return json.dumps(data.draw(JSON), allow_nan=True).encode()
    return data.draw(st.binary(max_size=max_raw))
