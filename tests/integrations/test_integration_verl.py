"""verl drop-in: SGLang answers in verl's vLLM prompt_logprobs contract (position 0 skipped,
best first, one pad row), nested and b64, with errors instead of asserts."""

from __future__ import annotations

import base64
import math
from typing import Any

import aiohttp
import anyio
import numpy as np
import pytest
import torch
from support.sglang_api import post_json

from opd_stream import ConfigError, MalformedResponseError, MisalignedResponseError
from opd_stream.integrations.verl import (
    extract_prompt_logprobs,
    fill_prompt_logprobs,
    sglang_prompt_logprobs_params,
)
from opd_stream.testing.mock_sglang import serve_mock


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


def _t(lp: float | None, i: int) -> list[Any]:
    return [lp, i, None]


# The teacher top-k of docs/semantics.md, "Worked example", for tokens [10, 11, 12]:
# {2: .5, 3: .5}, then {4: .8, 6: .2}.
EXAMPLE_META = {
    "input_token_logprobs": [_t(None, 10), _t(math.log(0.1), 11), _t(math.log(0.2), 12)],
    "input_top_logprobs": [
        None,
        [_t(math.log(0.5), 2), _t(math.log(0.5), 3)],
        [_t(math.log(0.8), 4), _t(math.log(0.2), 6)],
    ],
}


def test_spec_teacher_top_k_becomes_best_first_rows_and_one_pad_row() -> None:
    ids, lps = extract_prompt_logprobs(EXAMPLE_META, 2, 3)
    assert ids == [[2, 3], [4, 6], [0, 0]]
    want = [[math.log(0.5)] * 2, [math.log(0.8), math.log(0.2)], [0.0, 0.0]]
    assert lps == want


def test_sampled_token_rows_hold_the_scored_token_and_position_zero_is_skipped() -> None:
    result: dict[str, Any] = {}
    fill_prompt_logprobs(EXAMPLE_META, 0, 3, result)
    assert result["prompt_ids"] == [[11], [12], [0]]
    assert result["prompt_logprobs"] == [[math.log(0.1)], [math.log(0.2)], [0.0]]


def test_fewer_top_entries_than_asked_is_a_validation_error_naming_the_position() -> None:
    meta = {
        **EXAMPLE_META,
        "input_top_logprobs": [None, EXAMPLE_META["input_top_logprobs"][1], None],
    }
    with pytest.raises(MisalignedResponseError, match=r"0 top logprobs at position 2, expected 2"):
        extract_prompt_logprobs(meta, 2, 3)
    short = {**EXAMPLE_META, "input_top_logprobs": EXAMPLE_META["input_top_logprobs"][:2]}
    with pytest.raises(MisalignedResponseError, match=r"2 entries, expected 3"):
        extract_prompt_logprobs(short, 2, 3)


def test_length_mismatch_missing_field_and_bad_arguments_are_errors() -> None:
    with pytest.raises(MisalignedResponseError, match=r"length \(3\) does not match .* \(4\)"):
        extract_prompt_logprobs(EXAMPLE_META, 0, 4)
    with pytest.raises(MalformedResponseError, match="input_top_logprobs is missing"):
        extract_prompt_logprobs(
            {"input_token_logprobs": EXAMPLE_META["input_token_logprobs"]}, 2, 3
        )
    with pytest.raises(ConfigError, match="num_prompt_logprobs"):
        extract_prompt_logprobs(EXAMPLE_META, -1, 3)
    with pytest.raises(ConfigError, match="num_prompt_logprobs"):
        sglang_prompt_logprobs_params(-2)
    with pytest.raises(MisalignedResponseError, match=r"input_token_logprobs\[2\] echoes"):
        extract_prompt_logprobs(EXAMPLE_META, 0, 3, input_ids=[10, 11, 99])


def test_null_logprob_is_minus_infinity() -> None:
    meta = {"input_token_logprobs": [_t(None, 1), _t(None, 2)]}
    assert extract_prompt_logprobs(meta, 0, 2)[1] == [[-math.inf], [0.0]]


def test_b64_top_k_gives_the_same_lists_as_nested() -> None:
    vals = np.log(np.array([[0.5, 0.5], [0.8, 0.2]], dtype=np.float32)).astype("<f4")
    idx = np.array([[2, 3], [4, 6]], dtype="<i4")
    meta = {
        "input_token_logprobs": EXAMPLE_META["input_token_logprobs"],
        "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 1,
        "input_top_logprobs_val_flat_b64": base64.b64encode(vals.tobytes()).decode(),
        "input_top_logprobs_idx_flat_b64": base64.b64encode(idx.tobytes()).decode(),
    }
    ids, lps = extract_prompt_logprobs(meta, 2, 3)
    assert ids == [[2, 3], [4, 6], [0, 0]]
    for got, want in zip(lps[:2], vals.tolist(), strict=True):
        assert got == [float(np.float32(v)) for v in want]
    with pytest.raises(MisalignedResponseError, match="2 top logprobs per position, expected 3"):
        extract_prompt_logprobs(meta, 3, 3)


@pytest.mark.parametrize(("k", "b64"), [(0, False), (4, False), (4, True)])
async def test_mock_server_answers_match_the_closed_form_model(k: int, b64: bool) -> None:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 5000, 9).tolist()
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        **sglang_prompt_logprobs_params(k),
    }
    if b64:
        body["return_flat_raw_top_logprobs"] = True
        body["return_flat_raw_top_logprobs_b64"] = True
    async with serve_mock("teacher", 2) as server, aiohttp.ClientSession() as session:
        status, answer = await post_json(session, server.url, body)
        model = server.model
    assert status == 200
    assert b64 == ("input_top_logprobs_val_flat_b64" in answer["meta_info"])
    ids, lps = extract_prompt_logprobs(answer["meta_info"], k, len(tokens), input_ids=tokens)
    width = max(k, 1)
    assert len(ids) == len(lps) == len(tokens)
    assert all(len(r) == width for r in ids) and all(len(r) == width for r in lps)
    assert ids[-1] == [0] * width and lps[-1] == [0.0] * width
    tok = np.asarray(tokens)
    for j in range(1, len(tokens)):
        pos = np.array([j])
        if k == 0:
            want_ids = [tokens[j]]
            want_lps = [float(np.float32(model.token_logprobs(tok, pos)[0]))]
        else:
            top_ids, top_lps = model.topk(tok, pos, k)
            want_ids = [int(x) for x in top_ids[0]]
            want_lps = [float(np.float32(x)) for x in top_lps[0]]
        assert ids[j - 1] == want_ids, j
        for g, e in zip(lps[j - 1], want_lps, strict=True):
            assert g == e or (math.isinf(g) and math.isinf(e)), (j, g, e)


# --- issue 14: converter fixes -------------------------------------------------------------
def test_nan_is_minus_infinity_in_the_nested_and_b64_forms_alike() -> None:
    nested = {
        **EXAMPLE_META,
        "input_top_logprobs": [
            None,
            [_t(math.nan, 2), _t(math.log(0.5), 3)],
            EXAMPLE_META["input_top_logprobs"][2],
        ],
    }
    vals = np.array([[np.nan, math.log(0.5)], [math.log(0.8), math.log(0.2)]], dtype="<f4")
    idx = np.array([[2, 3], [4, 6]], dtype="<i4")
    b64 = {
        "input_token_logprobs": EXAMPLE_META["input_token_logprobs"],
        "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 1,
        "input_top_logprobs_val_flat_b64": base64.b64encode(vals.tobytes()).decode(),
        "input_top_logprobs_idx_flat_b64": base64.b64encode(idx.tobytes()).decode(),
    }
    a, b = extract_prompt_logprobs(nested, 2, 3), extract_prompt_logprobs(b64, 2, 3)
    assert a[0] == b[0] == [[2, 3], [4, 6], [0, 0]]
    assert a[1][0][0] == b[1][0][0] == -math.inf
    tokens = {"input_token_logprobs": [_t(None, 1), _t(math.nan, 2)]}
    assert extract_prompt_logprobs(tokens, 0, 2)[1] == [[-math.inf], [0.0]]


def test_plain_flat_top_k_is_read() -> None:
    meta = {
        "input_token_logprobs": EXAMPLE_META["input_token_logprobs"],
        "input_top_logprobs_shape": [2, 2],
        "input_top_logprobs_null_prefix": 1,
        "input_top_logprobs_val_flat": [math.log(0.5), math.log(0.5), math.log(0.8), None],
        "input_top_logprobs_idx_flat": [2, 3, 4, 6],
    }
    ids, lps = extract_prompt_logprobs(meta, 2, 3)
    assert ids == [[2, 3], [4, 6], [0, 0]]
    assert lps == [[math.log(0.5)] * 2, [math.log(0.8), -math.inf], [0.0, 0.0]]
    short = {**meta, "input_top_logprobs_idx_flat": [2, 3, 4]}
    with pytest.raises(MisalignedResponseError, match="idx_flat holds 3 values, expected 4"):
        extract_prompt_logprobs(short, 2, 3)


@pytest.mark.parametrize("b64", [False, True])
async def test_mock_server_plain_and_b64_flat_answers_are_read(b64: bool) -> None:
    tokens = [5, 9, 11, 40, 7]
    body: dict[str, Any] = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        **sglang_prompt_logprobs_params(3),
        "return_flat_raw_top_logprobs": True,
    }
    if b64:
        body["return_flat_raw_top_logprobs_b64"] = True
    async with serve_mock("teacher", 2) as server, aiohttp.ClientSession() as session:
        status, answer = await post_json(session, server.url, body)
        model = server.model
    assert status == 200
    assert ("input_top_logprobs_val_flat" in answer["meta_info"]) == (not b64)
    ids, _ = extract_prompt_logprobs(answer["meta_info"], 3, len(tokens), input_ids=tokens)
    top, _ = model.topk(np.asarray(tokens), np.arange(1, len(tokens)), 3)
    assert ids[:-1] == top.tolist()


def test_an_aborted_answer_names_finish_reason_abort() -> None:
    from opd_stream import ServerAbortError

    meta = {**EXAMPLE_META, "finish_reason": {"type": "abort", "message": "out of memory"}}
    with pytest.raises(ServerAbortError, match=r"finish_reason=abort: out of memory"):
        extract_prompt_logprobs(meta, 2, 3)


# --- issue 14: TeacherManager -------------------------------------------------------------
from opd_stream import MockTransport, Response, StreamConfig  # noqa: E402
from opd_stream.integrations.verl import (  # noqa: E402
    TeacherManager,
    verl_teacher_names,
    verl_top_k,
)


def _expected(model: Any, tokens: list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """verl's rows from the closed-form model: row j is position j + 1; then the pad row."""
    tok = np.asarray(tokens)
    pos = np.arange(1, len(tokens))
    width = max(k, 1)
    if k == 0:
        ids = [[t] for t in tokens[1:]]
        lps = [[float(np.float32(x))] for x in model.token_logprobs(tok, pos)]
    else:
        top_ids, top_lps = model.topk(tok, pos, k)
        ids = top_ids.tolist()
        lps = [[float(np.float32(x)) for x in row] for row in top_lps]
    return [*ids, [0] * width], [*lps, [0.0] * width]


@pytest.mark.parametrize("k", [0, 1, 4])
async def test_teacher_manager_with_two_mock_teachers_and_64_concurrent_calls(k: int) -> None:
    import asyncio

    async with serve_mock("teacher", 0) as math_t, serve_mock("teacher", 7, replicas=2) as code_t:
        cfg = StreamConfig.from_env(
            {}, teachers={"math": math_t.url, "code": code_t.urls}, max_inflight=16
        )
        manager = TeacherManager(cfg, top_k=k)
        rng = np.random.default_rng(k)
        calls = []
        for i in range(64):
            n = int(rng.integers(1, 40))
            calls.append((rng.integers(0, 5000, n).tolist(), "math" if i % 2 else "code"))
        try:
            out = await asyncio.gather(
                *(
                    manager.compute_teacher_logprobs_single(
                        sequence_ids=seq, multi_modal_data={}, routing_key=key
                    )
                    for seq, key in calls
                )
            )
            assert manager.stream is not None
            served = manager.stream.stats().endpoints
        finally:
            await manager.aclose()
        assert manager.stream is None
        assert sum(e.requests for e in served.values()) == sum(len(s) > 1 for s, _ in calls)
        models = {"math": math_t.model, "code": code_t.model}
    width = max(k, 1)
    for (seq, key), (ids, lps) in zip(calls, out, strict=True):
        assert ids.dtype == torch.int32 and lps.dtype == torch.float32
        assert tuple(ids.shape) == tuple(lps.shape) == (len(seq), width)
        want_ids, want_lps = _expected(models[key], seq, k)
        assert ids.tolist() == want_ids
        for got_row, want_row in zip(lps.tolist(), want_lps, strict=True):
            for g, e in zip(got_row, want_row, strict=True):
                assert g == e or (math.isinf(g) and math.isinf(e) and g < 0), (g, e)


def _null_rows_server(method: str, url: str, body: bytes) -> Response:
    """A teacher whose answers hold null logprobs (probability 0) in both row kinds."""
    import json as _json

    req = _json.loads(body)
    ids, k = req["input_ids"], req.get("top_logprobs_num", 0)
    start = req["logprob_start_len"]
    meta: dict[str, Any] = {
        "finish_reason": {"type": "length", "length": 0},
        "input_token_logprobs": [
            [None if j in (0, 2) else -1.5, ids[j], None] for j in range(start, len(ids))
        ],
    }
    if k:
        meta["input_top_logprobs"] = [
            None if j == 0 else [[-0.5, 7, None], [None, 9, None]][:k]
            for j in range(start, len(ids))
        ]
    return Response(200, _json.dumps({"text": "", "meta_info": meta}).encode())


@pytest.mark.parametrize("k", [0, 2])
async def test_null_logprobs_are_minus_infinity_rows(k: int) -> None:
    cfg = StreamConfig.from_env({}, teachers="http://t:1", topk_wire="json")
    manager = TeacherManager(cfg, top_k=k, transport=MockTransport(_null_rows_server))
    try:
        ids, lps = await manager.compute_teacher_logprobs_single([3, 4, 5, 6])
    finally:
        await manager.aclose()
    if k == 0:
        assert ids.tolist() == [[4], [5], [6], [0]]
        assert lps.tolist() == [[-1.5], [-math.inf], [-1.5], [0.0]]
    else:
        assert ids.tolist() == [[7, 9]] * 3 + [[0, 0]]
        assert lps.tolist() == [[-0.5, -math.inf]] * 3 + [[0.0, 0.0]]


async def test_teacher_manager_calls_show_in_the_streams_stats_and_cancel_their_requests() -> None:
    import asyncio

    hung: list[str] = []

    async def teacher(method: str, url: str, body: bytes) -> Response:
        if b'"input_ids":[9,' in body.replace(b" ", b""):  # this one never answers
            hung.append("started")
            try:
                await asyncio.sleep(3600)
            finally:
                hung.append("cancelled")
        return _null_rows_server(method, url, body)

    cfg = StreamConfig.from_env({}, teachers="http://t:1", topk_wire="json")
    manager = TeacherManager(cfg, top_k=2, transport=MockTransport(teacher))
    try:
        for seq in ([3, 4, 5], [6, 7], [8, 1, 2, 3]):
            await manager.compute_teacher_logprobs_single(seq)
        call = asyncio.create_task(manager.compute_teacher_logprobs_single([9, 1, 2]))
        with anyio.fail_after(10):
            while not hung:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert manager.stream is not None
        with anyio.fail_after(10):
            while manager.stream.stats().failed < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        stats = manager.stream.stats()
    finally:
        await manager.aclose()
    assert hung == ["started", "cancelled"]
    assert stats.admitted == 4 and stats.completed == 3
    assert stats.failures == {"cancelled": 1} and stats.in_flight == 0


async def test_verl_routing_rules() -> None:
    cfg = StreamConfig.from_env({}, teachers="a=http://a:1,b=http://b:1")
    manager = TeacherManager(cfg, top_k=0, teacher_key="data_source")
    with pytest.raises(ValueError, match=r"Routing key is required .*teacher_key='data_source'"):
        await manager.compute_teacher_logprobs_single([1, 2], routing_key=None)
    with pytest.raises(ValueError, match=r"No teacher configured for routing key 'c'"):
        await manager.compute_teacher_logprobs_single([1, 2], routing_key="c")
    await manager.aclose()
    # One teacher takes every sample, whatever its key.
    one = TeacherManager(
        StreamConfig.from_env({}, teachers="only=http://o:1"),
        top_k=0,
        transport=MockTransport(_null_rows_server),
    )
    try:
        for key in (None, "c", "only"):
            ids, _ = await one.compute_teacher_logprobs_single([1, 2, 3], routing_key=key)
            assert ids.tolist() == [[2], [3], [0]]
    finally:
        await one.aclose()


async def test_one_token_gives_the_pad_row_alone_and_close_is_final() -> None:
    transport = MockTransport(_null_rows_server)
    manager = TeacherManager(
        StreamConfig.from_env({}, teachers="http://t:1"), top_k=3, transport=transport
    )
    ids, lps = await manager.compute_teacher_logprobs_single([42])
    assert ids.tolist() == [[0, 0, 0]] and lps.tolist() == [[0.0, 0.0, 0.0]]
    assert transport.requests == 0
    with pytest.raises(NotImplementedError, match="multi-modal"):
        await manager.compute_teacher_logprobs_single([1, 2], multi_modal_data={"images": [1]})
    await manager.aclose()
    await manager.aclose()  # idempotent


def _verl_config(**loss: Any) -> dict[str, Any]:
    return {
        "distillation": {
            "enabled": True,
            "teacher_key": "data_source",
            "teacher_models": {
                "teacher_model": {"key": None, "model_path": "x"},
                "t1": {"key": "openai/gsm8k", "model_path": "a"},
                "t2": {"key": "geometry3k", "model_path": "b"},
            },
            "distillation_loss": {"loss_mode": "k3", "topk": 16, **loss},
        }
    }


def test_from_verl_config_reads_k_names_and_the_servers() -> None:
    env = {"OPD_STREAM_TEACHERS": "openai/gsm8k=http://g:1,geometry3k=http://h:1"}
    manager = TeacherManager.from_verl_config(_verl_config(), teacher_client=None, environ=env)
    assert manager.top_k == 0  # k3 is not a top-k loss
    assert sorted(manager.config.teachers) == ["geometry3k", "openai/gsm8k"]
    cfg = _verl_config(loss_mode="forward_kl_topk")
    assert TeacherManager.from_verl_config(cfg, environ=env).top_k == 16
    cfg = _verl_config(loss_settings={"use_topk": True}, topk=8)
    assert verl_top_k(cfg) == 8 and verl_top_k(cfg["distillation"]) == 8
    assert verl_teacher_names(cfg) == ["openai/gsm8k", "geometry3k"]
    single = {"distillation": {"teacher_models": {"teacher_model": {"model_path": "x"}}}}
    assert verl_teacher_names(single) == ["default"]
    one = TeacherManager.from_verl_config(single, environ={"OPD_STREAM_TEACHERS": "http://t:1"})
    assert one.teacher_key == "data_source"
    with pytest.raises(ValueError, match=r"route to \['geometry3k', 'openai/gsm8k'\]"):
        TeacherManager.from_verl_config(
            _verl_config(), environ={"OPD_STREAM_TEACHERS": "x=http://x:1"}
        )
    with pytest.raises(ValueError, match="OPD_STREAM_MAX_INFLIGHT"):
        TeacherManager.from_verl_config(
            _verl_config(), environ={**env, "OPD_STREAM_MAX_INFLIGHT": "x"}
        )


def test_the_agent_loop_recipe_swaps_the_teacher_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl cannot be imported here: stub its contract (``docs/internals.md``, "The verl
    contract") and check the wiring."""
    import importlib
    import sys
    import types

    built: dict[str, Any] = {}

    class AgentLoopWorker:  # verl's: builds its own teacher manager from the clients
        def __init__(
            self, config: Any, llm_client: Any, teacher_client: Any = None, *a: Any
        ) -> None:
            names = set(config["distillation"]["teacher_models_resolved"])
            if set(teacher_client) != names:  # verl's own check
                raise ValueError("teacher client keys do not match")
            self.distillation_enabled = True
            self.teacher_server_manager = "verl's"

    class AgentLoopManager:
        def __init__(self, config: Any, *a: Any, **kw: Any) -> None:
            if not hasattr(self, "agent_loop_workers_class"):
                self.agent_loop_workers_class = AgentLoopWorker
            built["worker"] = self.agent_loop_workers_class(config, "llm", None)

    mod = types.ModuleType("verl.experimental.agent_loop.agent_loop")
    mod.AgentLoopWorker = AgentLoopWorker  # type: ignore[attr-defined]
    mod.AgentLoopManager = AgentLoopManager  # type: ignore[attr-defined]
    ray = types.ModuleType("ray")
    ray.remote = lambda cls: cls  # type: ignore[attr-defined]
    for name in ("verl", "verl.experimental", "verl.experimental.agent_loop"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.experimental.agent_loop.agent_loop", mod)
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.delitem(sys.modules, "opd_stream.integrations.verl_agent_loop", raising=False)
    monkeypatch.setenv("OPD_STREAM_TEACHERS", "openai/gsm8k=http://g:1,geometry3k=http://h:1")
    recipe = importlib.import_module("opd_stream.integrations.verl_agent_loop")
    config = _verl_config(loss_mode="forward_kl_topk")
    config["distillation"]["teacher_models_resolved"] = ["openai/gsm8k", "geometry3k"]
    recipe.OPDStreamAgentLoopManager(config)
    worker = built["worker"]
    assert isinstance(worker, recipe.OPDStreamAgentLoopWorker)
    assert isinstance(worker.teacher_server_manager, TeacherManager)
    assert worker.teacher_server_manager.top_k == 16


# --- issue 32: verl's configuration decides the loss; teachers verl cannot use --------------
def _one_teacher(loss_mode: str, topk: int = 4) -> dict[str, Any]:
    return {
        "distillation": {
            "teacher_models": {"teacher_model": {"model_path": "x"}},
            "distillation_loss": {"loss_mode": loss_mode, "topk": topk},
        }
    }


SERVER = {"OPD_STREAM_TEACHERS": "http://t:1"}


@pytest.mark.parametrize(
    ("loss_mode", "env", "named"),
    [
        ("forward_kl_topk", {"OPD_STREAM_DIVERGENCE": "jsd"}, "OPD_STREAM_DIVERGENCE"),
        ("k3", {"OPD_STREAM_DIVERGENCE": "jsd"}, "OPD_STREAM_DIVERGENCE"),
        (  # a valid opd_stream loss, silently not verl's: refused too
            "forward_kl_topk",
            {
                "OPD_STREAM_TOP_K": "4",
                "OPD_STREAM_DIVERGENCE": "forward_kl",
                "OPD_STREAM_WEIGHT_MODE": "teacher_p",
            },
            "OPD_STREAM_DIVERGENCE, OPD_STREAM_WEIGHT_MODE",
        ),
        ("forward_kl_topk_tail", {"OPD_STREAM_TAIL": "1"}, "OPD_STREAM_TAIL"),
        ("k3", {"OPD_STREAM_STRATEGY": "union"}, "OPD_STREAM_STRATEGY"),
        ("k3", {"OPD_STREAM_JSD_BETA": "0.3"}, "OPD_STREAM_JSD_BETA"),
    ],
)
def test_an_opd_stream_loss_variable_is_refused_naming_it_and_verls_loss_mode(
    loss_mode: str, env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        TeacherManager.from_verl_config(_one_teacher(loss_mode), environ=SERVER | env)
    message = str(caught.value)
    assert message.startswith(f"{named} set, but in verl the loss is verl's own "), message
    assert f"distillation.distillation_loss.loss_mode={loss_mode!r}" in message
    assert f"unset {named}" in message


def test_opd_stream_top_k_must_be_verls_k() -> None:
    with pytest.raises(ConfigError) as caught:
        TeacherManager.from_verl_config(
            _one_teacher("forward_kl_topk", 16), environ=SERVER | {"OPD_STREAM_TOP_K": "8"}
        )
    assert str(caught.value).startswith("OPD_STREAM_TOP_K='8', but verl decides K: ")
    assert "loss_mode='forward_kl_topk', topk=16) reads the teacher's top-16 ids" in str(
        caught.value
    )
    with pytest.raises(ConfigError, match=r"loss_mode='k3'\) reads the teacher's logprob of each"):
        TeacherManager.from_verl_config(
            _one_teacher("k3"), environ=SERVER | {"OPD_STREAM_TOP_K": "4"}
        )
    same = TeacherManager.from_verl_config(
        _one_teacher("forward_kl_topk", 16), environ=SERVER | {"OPD_STREAM_TOP_K": "16"}
    )
    assert same.top_k == 16 and same.config.top_k == 16


@pytest.mark.parametrize("k", [0, 2])
async def test_a_direct_manager_ignores_the_loss_settings_of_its_stream_config(k: int) -> None:
    cfg = StreamConfig.from_env(
        {},
        teachers="http://t:1",
        topk_wire="json",
        top_k=8,
        strategy="union",
        student_url="http://s:1",
        divergence="jsd",
        jsd_beta=0.3,
        tail=True,
    )
    manager = TeacherManager(cfg, top_k=k, transport=MockTransport(_null_rows_server))
    try:
        ids, lps = await manager.compute_teacher_logprobs_single([3, 4, 5, 6])
    finally:
        await manager.aclose()
    assert (manager.config.divergence, manager.config.tail, manager.config.top_k) == (
        "reverse_kl",
        False,
        k,
    )
    if k == 0:  # verl's rows, as without the settings (test_null_logprobs_are_...)
        assert ids.tolist() == [[4], [5], [6], [0]]
        assert lps.tolist() == [[-1.5], [-math.inf], [-1.5], [0.0]]
    else:
        assert ids.tolist() == [[7, 9]] * 3 + [[0, 0]]
        assert lps.tolist() == [[-0.5, -math.inf]] * 3 + [[0.0, 0.0]]


@pytest.mark.parametrize(
    ("loss_mode", "needs"),
    [("k3", "logprob of each of the student's tokens"), ("forward_kl_topk", "top-4 ids")],
)
def test_a_teacher_with_its_own_tokenizer_is_refused_at_construction_in_verls_terms(
    loss_mode: str, needs: str, tmp_path: Any
) -> None:
    from support.xtok_vocabs import write_small

    env = SERVER | {
        "OPD_STREAM_STUDENT_TOKENIZER": write_small(tmp_path, "a"),
        "OPD_STREAM_TEACHER_TOKENIZERS": write_small(tmp_path, "b"),
    }
    with pytest.raises(ConfigError) as caught:
        TeacherManager.from_verl_config(_one_teacher(loss_mode), environ=env)
    message = str(caught.value)
    assert message.startswith(
        "teacher 'default' has its own tokenizer (OPD_STREAM_TEACHER_TOKENIZERS), which "
        "verl cannot distill from: verl's loss (distillation.distillation_loss."
    ), message
    assert needs in message and f"loss_mode={loss_mode!r}" in message
    assert "leave OPD_STREAM_TEACHER_TOKENIZERS unset" in message
    assert "OPDStream.score" not in message and "strategy" not in message
    k = verl_top_k(_one_teacher(loss_mode))
    cfg = StreamConfig.from_env(env)
    with pytest.raises(ConfigError, match=r"^teacher 'default' has its own tokenizer"):
        TeacherManager(cfg, top_k=k)


async def test_an_empty_sequence_is_an_invalid_sample_as_documented() -> None:
    from opd_stream import InvalidSampleError

    transport = MockTransport(_null_rows_server)
    manager = TeacherManager(
        StreamConfig.from_env({}, teachers="http://t:1"), top_k=2, transport=transport
    )
    try:
        with pytest.raises(InvalidSampleError, match=r"^sequence_ids: empty") as caught:
            await manager.compute_teacher_logprobs_single([])
    finally:
        await manager.aclose()
    assert caught.value.field == "sequence_ids" and transport.requests == 0
