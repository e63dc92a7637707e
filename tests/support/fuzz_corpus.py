"""The corpora the answer decoders are fuzzed with (``test_fuzz_decode``, ``test_scanner_decode``).

``REQUESTS``: one score request of every wire form; ``VALID``: the fake scorer's well-formed
answer to each (parsed JSON, to mutate); ``FUZZ``: the hypothesis settings; ``json_values``
and ``field_values``: JSON values, and values SGLang fields plausibly take, hostile ones
included; :func:`paths_of` every path into a parsed answer and :func:`mutate` one edit
(replace, delete, duplicate, truncate, bump, b64-flip) at one path.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from support import fake_generate as wf

TOKENS = np.array([3, 17, 5, 29, 11, 2, 8], dtype=np.int64)
R = 4
IDS = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=np.int64)

REQUESTS = {
    "plain": ScoreRequest(tokens=TOKENS, response_length=R),
    "plain-zero": ScoreRequest(tokens=TOKENS, response_length=R, start="zero"),
    "topk-json": ScoreRequest(tokens=TOKENS, response_length=R, top_k=3),
    "topk-b64": ScoreRequest(tokens=TOKENS, response_length=R, top_k=3, topk_wire="b64"),
    "ids-per-position": ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS),
    "ids-flat": ScoreRequest(tokens=TOKENS, response_length=R, ids=IDS, id_form="flat"),
    "ids-blocked": ScoreRequest(
        tokens=TOKENS, response_length=R, ids=IDS, id_form="blocked", block_size=2, top_k=2
    ),
    "all-b64": ScoreRequest(tokens=TOKENS, response_length=R, top_k=2, ids=IDS, topk_wire="b64"),
}
VALID = {name: wf.answer(build_score_payload(req)) for name, req in REQUESTS.items()}

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
# values SGLang fields plausibly take, including hostile ones
field_values = st.one_of(
    json_values,
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([1e39, -1e39, 1e308, -0.0, 3.5, float(2**63)]),
    st.text(
        alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", max_size=40
    ),
    st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
    st.lists(st.lists(st.integers(-(2**65), 2**65), max_size=3), max_size=6),
)


def paths_of(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += paths_of(v, (*prefix, i))
    return out


def mutate(obj: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    if not path:
        return value if op == "replace" else obj
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if op == "replace":
        parent[key] = value
    elif op == "delete":
        del parent[key]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif op == "truncate" and isinstance(parent[key], (list, str)):
        parent[key] = parent[key][: len(parent[key]) // 2]
    elif (
        op == "bump" and isinstance(parent[key], (int, float)) and not isinstance(parent[key], bool)
    ):
        parent[key] = parent[key] + 1
    elif op == "b64-flip" and isinstance(parent[key], str) and parent[key]:
        text = parent[key]
        parent[key] = ("B" if text[0] != "B" else "C") + text[1:]
    return obj
