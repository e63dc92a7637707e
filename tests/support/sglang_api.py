"""Helpers for the mock SGLang server tests: SGLang's contract module and a tiny HTTP client.

``load_sglang_api_types()`` loads ``sglang/api/v1/api_types.py`` of the sglang 0.5.23 wheel
(unpacked by the set-up step into ``.cache/sglang/src/sglang/``) by path, without importing
sglang. If it is missing the calling test FAILS (never skips) and says how to create it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import msgspec
import pytest

__all__ = ("API_TYPES_PATH", "load_sglang_api_types", "post_json")

API_TYPES_PATH = (
    Path(__file__).resolve().parents[2] / ".cache/sglang/src/sglang/api/v1/api_types.py"
)
_SETUP_HINT = (
    "run the set-up step: `pip download --no-deps sglang==0.5.23 -d .cache/sglang` and unzip "
    "`sglang/api/v1/api_types.py` from the wheel into .cache/sglang/src/"
)


def load_sglang_api_types() -> ModuleType:
    """SGLang 0.5.23's ``api_types`` module, loaded by file path (fails the test if absent)."""
    name = "_sglang_0_5_23_api_types"
    if name in sys.modules:
        return sys.modules[name]
    if not API_TYPES_PATH.is_file():
        pytest.fail(f"SGLang contract file {API_TYPES_PATH} is missing: {_SETUP_HINT}")
    spec = importlib.util.spec_from_file_location(name, API_TYPES_PATH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def post_json(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """Send ``body`` as JSON to ``url + /generate``; return (status, decoded JSON or raw text)."""
    async with session.request(
        method, url + "/generate", data=msgspec.json.encode(body), headers=headers
    ) as resp:
        raw = await resp.read()
    try:
        return resp.status, msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return resp.status, raw.decode(errors="replace")
