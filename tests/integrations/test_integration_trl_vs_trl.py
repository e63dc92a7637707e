"""TRL drop-in against TRL 1.16.0's own client: ``TeacherClient.get_sequence_logprobs`` gives
exactly what TRL's ``VLLMClient.get_sequence_logprobs`` gives on the same mock vLLM server
(the same closed-form model behind every engine), list for list and value for value:
ranks, padding (-inf, id 0), vLLM's -9999.0, the actual tokens, empty completions and
position 0, at ``top_logprobs`` 1, 20, 100 and beyond; whichever engine our client speaks
(vLLM scale-out, vLLM completions, SGLang). And TRL's own trainer loss
(``ServerDistillationTrainer.compute_loss``, its teacher-server path) gives the same loss
on either client.

TRL's code runs from its wheel (``.cache/trl/src``, set up by ``scripts/dev.sh setup``;
see ``tests/support/trl_client.py``).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from support.trl_client import (
    TRL_CLIENT,
    load_server_distillation_trainer,
    mock_in_thread,
    trl_client,
)

from opd_stream.integrations.trl import SequenceScoringError, TeacherClient
from opd_stream.testing.mock_sglang import MockOptions, serve_mock
from opd_stream.testing.mock_vllm import VllmMockOptions, serve_vllm_mock
from opd_stream.wire._codec import decode_score_response
from opd_stream.wire._payloads import build_score_payload
from opd_stream.wire._request import ScoreRequest
from opd_stream.wire._vllm import sends_id_columns

pytestmark = pytest.mark.skipif(
    not TRL_CLIENT.is_file(),
    reason=f"TRL's source is not set up ({TRL_CLIENT}: scripts/dev.sh setup)",
)

V, HEAD = 1024, 128
MASKED = V - 1  # probability 0 everywhere: vLLM writes its logprob as -9999.0
MODEL = {"vocab_size": V, "head_size": HEAD}
ENGINES = ("vllm", "vllm-completions", "sglang")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    vllm = VllmMockOptions(**MODEL, max_logprobs=-1)
    with (
        mock_in_thread(lambda: serve_vllm_mock("teacher", 0, options=vllm)) as scale_out,
        mock_in_thread(
            lambda: serve_vllm_mock("teacher", 0, options=vllm, scale_out=False)
        ) as completions,
        mock_in_thread(lambda: serve_mock("teacher", 0, options=MockOptions(**MODEL))) as sglang,
    ):
        yield {"vllm": scale_out, "vllm-completions": completions, "sglang": sglang}


@pytest.fixture(scope="module")
def trl(servers: dict[str, Any]) -> Any:
    """TRL's own client, on the vLLM server (its ``/v1/completions``)."""
    return trl_client(servers["vllm"].url)


@pytest.fixture(scope="module")
def ours(servers: dict[str, Any]) -> Iterator[dict[str, TeacherClient]]:
    clients = {engine: TeacherClient(servers[engine].url, environ={}) for engine in ENGINES}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()


def batch(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """A GRPO-like batch: two groups sharing a prompt, an empty completion, a sequence scored
    from position 0, and completions holding a probability-0 token."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, V - 2, 12).tolist()
    seqs = [head + rng.integers(0, V - 2, n).tolist() for n in (9, 5, 7)]
    seqs.append(rng.integers(0, V - 2, 6).tolist())  # prompt_length 6: an empty completion
    seqs.append(rng.integers(0, V - 2, 5).tolist())  # prompt_length 0: position 0 has no context
    seqs.append([*head[:4], 17, MASKED, 3, MASKED])  # the actual token's logprob is -inf
    return seqs, [12, 12, 12, 6, 0, 4]


@pytest.mark.parametrize("k", [1, 20, 100, 150])
@pytest.mark.parametrize("engine", ENGINES)
def test_equal_to_trls_own_client_value_for_value(
    trl: Any, ours: dict[str, TeacherClient], engine: str, k: int
) -> None:
    seqs, lengths = batch()
    want = trl.get_sequence_logprobs(seqs, lengths, top_logprobs=k)
    got = ours[engine].get_sequence_logprobs(seqs, lengths, top_logprobs=k)
    assert got == want
    assert -9999.0 in [row[0] for row in want["actual_logprobs"][5]]  # the case is covered
    assert want["logprob_token_ids"][4][0] == [0] * k  # padding covered too
    stats = ours[engine].stats()[k]
    assert [ep.engine for ep in stats.endpoints.values()] == [engine]


def _post(url: str, body: bytes) -> bytes:
    req = urllib.request.Request(
        url + "/inference/v1/generate", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req) as resp:
        answer: bytes = resp.read()
    return answer


@pytest.mark.parametrize("k", [1, 20])
def test_the_sampled_tokens_logprob_in_the_dicts_is_the_npys_float32_bit_for_bit(
    servers: dict[str, Any], k: int
) -> None:
    # the teacher's top-k alone sends no id column and reads the sampled token's logprob
    # from the dicts: the very float32 the .npy column gives (masked tokens included)
    seqs, _ = batch()
    tokens = np.array(seqs[5], dtype=np.int64)  # holds two probability-0 tokens
    alone = ScoreRequest(tokens=tokens, response_length=4, top_k=k, engine="vllm")
    column = ScoreRequest(
        tokens=tokens, response_length=4, top_k=k, engine="vllm", ids=np.zeros((4, 1), np.int64)
    )
    assert not sends_id_columns(alone) and sends_id_columns(column)
    url = servers["vllm"].url
    got = decode_score_response(_post(url, build_score_payload(alone)), alone)
    want = decode_score_response(_post(url, build_score_payload(column)), column)
    assert got.token_logprobs.tobytes() == want.token_logprobs.tobytes()
    assert np.isneginf(got.token_logprobs).sum() == 2
    np.testing.assert_array_equal(got.top_logprobs, want.top_logprobs)


def test_a_new_clients_concurrent_first_sequences_all_find_the_vllm_engine(
    servers: dict[str, Any], trl: Any
) -> None:
    # every sequence goes out at once as SGLang; the first 404 detects vLLM, and the other
    # 404s (answered after that) ask again in vLLM's dialect instead of failing
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, V - 2, 20).tolist() for _ in range(16)]
    want = trl.get_sequence_logprobs(seqs, [10] * 16, top_logprobs=3)
    for _ in range(3):
        with TeacherClient(servers["vllm"].url, environ={}) as client:
            assert client.get_sequence_logprobs(seqs, [10] * 16, top_logprobs=3) == want


def test_minus_9999_inside_the_top_entries_is_kept_as_trl_passes_it_on() -> None:
    small = {"vocab_size": 64, "head_size": 16}  # top 64: the 2 masked ids are in the top
    with (
        mock_in_thread(
            lambda: serve_vllm_mock("teacher", 0, options=VllmMockOptions(**small, max_logprobs=-1))
        ) as server,
        TeacherClient(server.url, environ={}) as client,
    ):
        seqs, lengths = [[5, 9, 11, 2, 7]], [2]
        want = trl_client(server.url).get_sequence_logprobs(seqs, lengths, top_logprobs=64)
        got = client.get_sequence_logprobs(seqs, lengths, top_logprobs=64)
    assert got == want
    assert all(row[-2:] == [-9999.0, -9999.0] for row in want["logprobs"][0])


def test_a_stock_server_refuses_top_100_to_both_clients_and_ours_says_which_flag() -> None:
    stock = VllmMockOptions(**MODEL)  # --max-logprobs 20, vLLM's default
    seqs, lengths = batch()
    with mock_in_thread(lambda: serve_vllm_mock("teacher", 0, options=stock)) as server:
        with pytest.raises(Exception, match="400"):
            trl_client(server.url).get_sequence_logprobs(seqs, lengths, top_logprobs=100)
        # TRL's command line (--max-logprobs -1) assumed: the server's 400 read and explained
        with TeacherClient(server.url, environ={}) as client:
            with pytest.raises(SequenceScoringError, match="5 of 6 sequences") as info:
                client.get_sequence_logprobs(seqs, lengths, top_logprobs=100)
            assert "start vLLM with --max-logprobs 100 or more" in str(info.value)
        # the server's limit configured: refused as such
        env = {"OPD_STREAM_VLLM_MAX_LOGPROBS": "20"}
        with TeacherClient(server.url, environ=env) as client:
            with pytest.raises(SequenceScoringError, match="--max-logprobs 100 or more"):
                client.get_sequence_logprobs(seqs, lengths, top_logprobs=100)


def _trainer(client: Any, *, beta: float, top_k: int, tail: bool) -> Any:
    cls = load_server_distillation_trainer().ServerDistillationTrainer
    trainer = cls.__new__(cls)
    trainer.teacher_client = client
    trainer.beta = beta
    trainer.loss_top_k = top_k
    trainer.loss_add_tail = tail
    trainer.reverse_kl_top_1_mode = "sampled"
    trainer.temperature = 1.0
    return trainer


class _Student:
    """A stand-in student model: fixed random logits, not training."""

    training = False

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, **_: Any) -> Any:
        return self


def _inputs() -> dict[str, torch.Tensor]:
    """GRPO's keys as TRL's trainer gets them: left-padded prompts, right-padded
    completions (one of them empty), ids that include a probability-0 token."""
    seqs, lengths = batch(seed=1)
    rows = [(s[:p], s[p:]) for s, p in zip(seqs, lengths, strict=True) if p > 0][:4]
    rows[1] = (rows[1][0], rows[1][1][:2])
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    prompt_ids = torch.zeros((len(rows), width_p), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros((len(rows), width_c), dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, (p, c) in enumerate(rows):
        prompt_ids[i, width_p - len(p) :] = torch.tensor(p)
        prompt_mask[i, width_p - len(p) :] = 1
        completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        completion_mask[i, : len(c)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.mark.parametrize(
    ("beta", "top_k", "tail"), [(0.0, 20, True), (0.0, 100, False), (0.5, 1, True)]
)
def test_trls_own_loss_is_the_same_on_either_client(
    trl: Any, ours: dict[str, TeacherClient], beta: float, top_k: int, tail: bool
) -> None:
    inputs = _inputs()
    width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    logits = torch.randn((4, width, V), generator=torch.Generator().manual_seed(0))
    student = _Student(logits)
    losses = []
    for client in (trl, ours["vllm"]):
        trainer = _trainer(client, beta=beta, top_k=top_k, tail=tail)
        trainer.model = student
        losses.append(trainer.compute_loss(student, inputs))
    want, got = losses
    assert torch.isfinite(want)
    assert got.item() == want.item()
