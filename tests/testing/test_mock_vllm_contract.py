"""The mock vLLM server's wire contract against vLLM 0.34.0's own source (read with ``ast``,
never imported): every request field the mock reads exists in vLLM's request models with the
default the mock assumes, every field the mock writes exists in vLLM's response models, and
the mock's error messages are vLLM's (its 403 equal to ``factories.py``'s, its 400s matching
the f-strings of ``sampling_params.py`` / ``input_processor.py``).

The source comes from the set-up step (``scripts/dev.sh setup``: the ``vllm==0.34.0`` wheel,
``--no-deps``, unpacked into ``.cache/vllm/src``); if it is missing these tests fail, saying so.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from opd_stream.testing.mock_sglang import MockCluster
from opd_stream.testing.mock_vllm import SCALE_OUT_DISABLED, VllmMockOptions, serve_vllm_mock

SRC = Path(__file__).resolve().parents[2] / ".cache/vllm/src/vllm"
V = 1000
L = 8
TOKENS = list(range(3, 3 + L))
_MISSING = object()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})


@cache
def tree(rel: str) -> ast.Module:
    path = SRC / rel
    if not path.is_file():
        pytest.fail(
            f"vLLM 0.34.0 source {path} is missing: run the set-up step (scripts/dev.sh setup "
            "downloads the wheel with --no-deps and unpacks it into .cache/vllm/src)"
        )
    return ast.parse(path.read_text())


def _default(value: ast.expr | None) -> Any:
    if value is None:
        return _MISSING
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Field":
        for kw in value.keywords:
            if kw.arg == "default":
                return _default(kw.value)
            if kw.arg == "default_factory":
                return "<factory>"
        return _default(value.args[0]) if value.args else _MISSING
    try:
        return ast.literal_eval(value)
    except ValueError:
        return ast.unparse(value)


def fields(rel: str, cls: str) -> dict[str, Any]:
    """Field name -> default (``_MISSING`` when required) of ``cls`` and its bases in the
    same file."""
    classes = {n.name: n for n in ast.walk(tree(rel)) if isinstance(n, ast.ClassDef)}
    node = classes[cls]
    out: dict[str, Any] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(fields(rel, base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.unparse(stmt.annotation) or stmt.target.id.startswith("_"):
                continue
            out[stmt.target.id] = _default(stmt.value)
    return out


SAMPLING = "sampling_params.py"
SCALE_OUT = "entrypoints/scale_out/token_in_token_out/protocol.py"
COMPLETION = "entrypoints/openai/completion/protocol.py"
ENGINE = "entrypoints/serve/engine/protocol.py"

# What the mock reads, with the default it assumes when the field is absent.
SAMPLING_READ = {
    "n": 1,
    "temperature": 1.0,
    "seed": None,
    "max_tokens": 16,  # the dataclass default; the scale-out server replaces an absent one
    "stop": None,
    "stop_token_ids": None,
    "logprobs": None,
    "prompt_logprobs": None,
    "prompt_logprob_token_ids": None,
    "prompt_logprob_start": None,
    "skip_reading_prefix_cache": None,  # resolved in __post_init__: True with prompt scores
    "detokenize": True,
}
GENERATE_READ = {
    "token_ids": _MISSING,
    "sampling_params": _MISSING,
    "request_id": "<factory>",
    "cache_salt": None,
    "return_token_ids": None,
    "stream": False,
    "output_mode": "tokens",
}
COMPLETION_READ = {
    "prompt": None,
    "model": None,
    "max_tokens": 16,
    "temperature": None,
    "prompt_logprobs": None,
    "stream": False,
    "echo": False,
    "logprobs": None,
    "n": 1,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "cache_salt": None,
    "return_token_ids": None,
    "return_weight_versions": False,
    "request_id": "<factory>",
}


@pytest.mark.parametrize(
    ("rel", "cls", "read"),
    [
        (SAMPLING, "SamplingParams", SAMPLING_READ),
        (SCALE_OUT, "GenerateRequest", GENERATE_READ),
        (COMPLETION, "CompletionRequest", COMPLETION_READ),
    ],
)
def test_every_request_field_the_mock_reads_exists_with_the_assumed_default(
    rel: str, cls: str, read: dict[str, Any]
) -> None:
    have = fields(rel, cls)
    assert {k: have.get(k, "<absent>") for k in read} == read


def test_skip_reading_prefix_cache_defaults_to_true_with_prompt_scores() -> None:
    src = (SRC / SAMPLING).read_text()
    assert re.search(
        r"self\.skip_reading_prefix_cache = \(\s*self\.prompt_logprobs is not None\s*"
        r"or self\.prompt_logprob_token_ids is not None\s*\)",
        src,
    )


async def _answers(session: aiohttp.ClientSession, srv: MockCluster) -> dict[str, Any]:
    rows = [[TOKENS[i + 1], 1] for i in range(L - 1)]
    sp = {"max_tokens": 1, "prompt_logprobs": 2, "prompt_logprob_token_ids": rows}
    out: dict[str, Any] = {}
    async with session.post(
        srv.url + "/inference/v1/generate",
        json={"token_ids": TOKENS, "sampling_params": sp, "return_token_ids": True},
    ) as r:
        out["generate"] = await r.json()
    async with session.post(
        srv.url + "/v1/completions",
        json={
            "prompt": TOKENS,
            "max_tokens": 1,
            "prompt_logprobs": 1,
            "return_weight_versions": True,
        },
    ) as r:
        out["completions"] = await r.json()
    async with session.get(srv.url + "/v1/models") as r:
        out["models"] = await r.json()
    return out


async def test_every_response_field_the_mock_writes_exists_in_vllms_models(
    session: aiohttp.ClientSession,
) -> None:
    async with serve_vllm_mock(options=VllmMockOptions(vocab_size=V, head_size=16)) as srv:
        ans = await _answers(session, srv)
    gen = ans["generate"]
    assert set(gen) == set(fields(SCALE_OUT, "GenerateTokensResponse"))
    assert set(gen["choices"][0]) == set(fields(SCALE_OUT, "GenerateTokensChoice"))
    span = fields("outputs.py", "WeightVersionSpan")
    assert set(gen["choices"][0]["weight_versions"][0]) == set(span)
    usage = fields(ENGINE, "UsageInfo")
    assert set(gen["usage"]) == set(usage)
    assert set(gen["usage"]["prompt_tokens_details"]) == set(fields(ENGINE, "PromptTokenUsageInfo"))
    logprob = fields("logprobs.py", "Logprob")
    entries = [e for d in gen["prompt_logprobs"] if d for e in d.values()]
    assert entries and all(set(e) == set(logprob) for e in entries)
    cmpl = ans["completions"]
    assert set(cmpl) == set(fields(COMPLETION, "CompletionResponse"))
    assert set(cmpl["choices"][0]) == set(fields(COMPLETION, "CompletionResponseChoice"))
    assert set(cmpl["choices"][0]["weight_versions"][0]) == set(span)
    assert set(ans["models"]) == set(fields(ENGINE, "ModelList"))
    card = ans["models"]["data"][0]
    assert set(card) == set(fields(ENGINE, "ModelCard"))
    assert set(card["permission"][0]) == set(fields(ENGINE, "ModelPermission"))


def test_the_403_message_is_factories_pys() -> None:
    fn = next(
        n
        for n in ast.walk(tree("entrypoints/scale_out/factories.py"))
        if isinstance(n, ast.FunctionDef) and n.name == "register_scale_out_api_routers"
    )
    message = next(
        n.value.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and getattr(n.targets[0], "id", "") == "message"
        and isinstance(n.value, ast.Constant)
    )
    assert message == SCALE_OUT_DISABLED
    call = ast.unparse(fn)
    assert "create_error_response(message, 'PermissionDeniedError', HTTPStatus.FORBIDDEN)" in call
    assert set(fields(ENGINE, "ErrorInfo")) == {"message", "type", "param", "code"}


def _message_patterns(rel: str) -> list[re.Pattern[str]]:
    """Every ``VLLMValidationError`` message of ``rel`` as a regex (formatted parts: ``.+``)."""
    out = []
    for node in ast.walk(tree(rel)):
        if not (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "VLLMValidationError"
            and node.args
        ):
            continue
        arg = node.args[0]
        parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
        regex = ""
        for part in parts:
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                regex += re.escape(part.value)
            else:
                regex += ".+"
        out.append(re.compile(regex))
    return out


REJECTED = [
    {"prompt_logprobs": 21},
    {"prompt_logprob_token_ids": [list(range(21))] * (L - 1)},
    {"prompt_logprob_token_ids": [[1]] * (L - 2)},
    {"prompt_logprob_token_ids": [[V]] * (L - 1)},
    {"prompt_logprob_token_ids": [[]]},
    {"prompt_logprob_start": 2},
    {"prompt_logprob_start": L - 1, "prompt_logprobs": 1},
    {"max_tokens": 0},
    {"temperature": 3.0},
    {"prompt_logprobs": -2},
]


async def test_the_mocks_400_messages_are_vllms(session: aiohttp.ClientSession) -> None:
    patterns = _message_patterns(SAMPLING) + _message_patterns("v1/engine/input_processor.py")
    async with serve_vllm_mock(options=VllmMockOptions(vocab_size=V, head_size=16)) as srv:
        for sp in REJECTED:
            body = {"token_ids": TOKENS, "sampling_params": {"max_tokens": 1, **sp}}
            async with session.post(srv.url + "/inference/v1/generate", json=body) as r:
                assert r.status == 400, sp
                message = (await r.json())["error"]["message"]
            # A body-layer error wraps the sentence in pydantic's report; the sentence is vLLM's.
            sentence = message.rsplit("Value error, ", 1)[-1]
            assert any(p.fullmatch(sentence) for p in patterns), (sp, sentence)


COMPLETION_REJECTED = [
    {"prompt_logprobs": -3},
    {"prompt_logprobs": 2, "stream": True},
    {"prompt_logprobs": 21},
    {"max_tokens": 0},
]


async def test_the_completions_400_messages_are_vllms(session: aiohttp.ClientSession) -> None:
    patterns = _message_patterns(COMPLETION) + _message_patterns(SAMPLING)
    async with serve_vllm_mock(options=VllmMockOptions(vocab_size=V, head_size=16)) as srv:
        for extra in COMPLETION_REJECTED:
            body = {"prompt": TOKENS, "max_tokens": 1, **extra}
            async with session.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 400, extra
                message = (await r.json())["error"]["message"]
            sentence = message.rsplit("Value error, ", 1)[-1]
            assert any(p.fullmatch(sentence) for p in patterns), (extra, sentence)


def test_the_mock_is_independent_of_the_client_code() -> None:
    """The mock is the reference the client is tested against: it imports nothing of the
    client (wire, fetch, fleet, config), only the SGLang mock it shares the model with."""
    import opd_stream.testing.mock_vllm as pkg

    client = ("wire", "fetch", "fleet", "config", "stream", "kl")
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                parts = module.split(".")
                if node.level == 0:
                    assert parts[0] != "opd_stream" or parts[1] == "testing", (path, module)
                else:  # relative: at most up to opd_stream.testing
                    assert node.level <= 2 and parts[0] not in client, (path, module)
            elif isinstance(node, ast.Import):
                assert all(not a.name.startswith("opd_stream") for a in node.names), path
