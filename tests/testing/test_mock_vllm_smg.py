"""smg 1.13.0 (engine-agnostic model gateway) in front of mock vLLM workers, against the real
binary: which scoring paths pass.

* smg registers vLLM workers (``runtime_type`` ``"vllm"``, read from ``/version`` and
  ``/v1/models``), with or without ``--backend vllm``.
* ``POST /inference/v1/generate`` (vLLM scale-out, the binary per-position path) is not a
  route of smg: it answers 404 ``unknown_url`` itself, whatever ``--backend`` / ``--policy``.
* ``POST /v1/completions`` is parsed by smg: a prompt of token ids (what a scorer sends) is
  refused with 400 (``prompt`` must be a string or a list of strings), and the body needs a
  ``model``; only text prompts reach a worker.

So vLLM teachers behind smg 1.13.0 are scored directly: router discovery (``GET /workers``)
lists them, and requests then go to the workers, never through smg.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support.routers import _launched

from opd_stream.fleet._discovery import parse_gateway_workers
from opd_stream.testing.mock_vllm import VllmMockOptions, VllmMockProcess
from opd_stream.testing.router import SMGGateway

TOKENS = list(range(3, 11))
OPTS = VllmMockOptions(vocab_size=1000, head_size=16)


def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[str]]]:
    """Two workers behind smg ``--backend vllm`` (its default backend, sglang, answers the
    same on these paths; one gateway start keeps the module short)."""
    workers = [VllmMockProcess("teacher", 1, options=OPTS) for _ in range(2)]
    try:
        urls = [w.start() for w in workers]
        with _launched(
            SMGGateway, "smg", "smg", workers=urls, extra_args=["--backend", "vllm"]
        ) as gateway:
            yield gateway, urls
    finally:
        for w in workers:
            w.kill()


def test_smg_registers_vllm_workers_and_discovery_lists_them(
    fleet: tuple[str, list[str]],
) -> None:
    gateway, urls = fleet
    with urllib.request.urlopen(gateway + "/workers", timeout=5) as resp:
        body = resp.read()
    listed = json.loads(body)["workers"]
    assert {w["url"] for w in listed} == set(urls)
    assert {w["runtime_type"] for w in listed} == {"vllm"}
    # The client's router discovery reads the same listing: its workers are then scored
    # directly, the scale-out path included.
    assert sorted(parse_gateway_workers(body) or []) == sorted(urls)


def test_the_scale_out_path_is_not_routed(fleet: tuple[str, list[str]]) -> None:
    gateway, urls = fleet
    body = {
        "token_ids": TOKENS,
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": [[1]] * (len(TOKENS) - 1)},
    }
    status, ans = post(gateway + "/inference/v1/generate", body)
    assert status == 404 and ans["error"]["code"] == "unknown_url"
    assert all("/inference/v1/generate" not in get(u + "/mock/stats")["by_endpoint"] for u in urls)
    status, _ = post(urls[0] + "/inference/v1/generate", body)  # the worker itself answers
    assert status == 200


def test_completions_with_token_ids_are_refused_by_smg(fleet: tuple[str, list[str]]) -> None:
    gateway, urls = fleet
    body = {"model": "mock-teacher", "prompt": TOKENS, "max_tokens": 1, "prompt_logprobs": 1}
    status, ans = post(gateway + "/v1/completions", body)
    assert status == 400 and "StringOrArray" in ans["error"]["message"]
    assert all("/v1/completions" not in get(u + "/mock/stats")["by_endpoint"] for u in urls)
    # A text prompt is forwarded (the tokenizer-less mock worker then refuses it itself).
    status, ans = post(gateway + "/v1/completions", {**body, "prompt": ["hello"]})
    assert status == 400 and "no tokenizer" in ans["error"]["message"]
