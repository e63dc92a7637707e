"""TRL drop-in: ``TeacherClient.get_sequence_logprobs`` gives TRL 1.16.0's contract (rows
from each prompt's end, top entries by rank padded with -inf / id 0, the actual token's
logprob, vLLM's -9999.0 for a probability-0 token), checked against a float64 reference
built with loops from the mock's closed-form model; bad input and failed sequences raise
clearly; the client's loop thread is joined on close and never keeps the interpreter alive.

(The same calls against TRL's own client on vLLM mocks:
tests/integrations/test_integration_trl_vs_trl.py.)
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.trl_client import mock_in_thread

from opd_stream import ConfigError, InvalidSampleError, StreamConfig
from opd_stream.integrations.trl import SequenceScoringError, TeacherClient
from opd_stream.testing.mock_sglang import MockModel, MockOptions, serve_mock

V, HEAD = 512, 16
OPTIONS = MockOptions(vocab_size=V, head_size=HEAD)
MODEL = MockModel("teacher", 0, V, head_size=HEAD)
MASKED = V - 1  # a masked id: probability 0 (logprob -inf) everywhere


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with mock_in_thread(lambda: serve_mock("teacher", 0, options=OPTIONS)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[TeacherClient]:
    with TeacherClient(server.url, environ={}) as c:
        yield c


def reference(sequences: list[list[int]], prompt_lengths: list[int], k: int) -> dict[str, Any]:
    """TRL's contract from the model, one position at a time (float64, values sent as
    float32, a probability-0 token's -inf as vLLM's -9999.0, padding -inf / id 0)."""

    def wire(x: float) -> float:
        return -9999.0 if x == -math.inf else float(np.float32(x))

    out: dict[str, list[Any]] = {
        "logprobs": [],
        "logprob_token_ids": [],
        "actual_logprobs": [],
        "actual_token_ids": [],
    }
    for seq, p in zip(sequences, prompt_lengths, strict=True):
        rows: list[list[list[Any]]] = [[], [], [], []]
        for pos in range(p, len(seq)):
            if pos == 0:
                vals, ids, act = [-math.inf] * k, [0] * k, -math.inf
            else:
                top_ids, top_lp = MODEL.topk(seq, [pos], k)
                vals = [wire(float(x)) for x in top_lp[0]]
                ids = [int(i) for i in top_ids[0]]
                act = wire(float(MODEL.logprobs(seq, [pos], [[seq[pos]]])[0, 0]))
            for j, value in enumerate((vals, ids, [act], [seq[pos]])):
                rows[j].append(value)
        for key, value in zip(out, rows, strict=True):
            out[key].append(value)
    return out


def sequences(n: int, prompt: int, response: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V - 2, prompt + response).tolist() for _ in range(n)]


@pytest.mark.parametrize("k", [1, 5, HEAD + 4])
def test_rows_are_the_teachers_top_entries_by_rank_and_the_actual_tokens(
    client: TeacherClient, k: int
) -> None:
    seqs = sequences(3, 6, 5)
    lengths = [6, 4, 9]
    got = client.get_sequence_logprobs(seqs, lengths, top_logprobs=k)
    assert got == reference(seqs, lengths, k)
    assert [len(rows) for rows in got["logprobs"]] == [5, 7, 2]


def test_a_probability_zero_token_is_minus_9999_as_vllm_writes_it(client: TeacherClient) -> None:
    seq = [3, 8, MASKED, 5, MASKED]
    got = client.get_sequence_logprobs([seq], [2], top_logprobs=2)
    actual = [row[0] for row in got["actual_logprobs"][0]]
    assert actual[0] == actual[2] == -9999.0
    assert -9999.0 < actual[1] < 0
    assert got == reference([seq], [2], 2)


def test_position_zero_is_a_padding_row_and_empty_completions_have_no_rows(
    client: TeacherClient,
) -> None:
    seqs = [[7, 9, 11], [4, 5], [6]]
    got = client.get_sequence_logprobs(seqs, [0, 2, 0], top_logprobs=3)
    assert got["logprobs"][0][0] == [-math.inf] * 3
    assert got["logprob_token_ids"][0][0] == [0, 0, 0]
    assert got["actual_logprobs"][0][0] == [-math.inf]
    assert [got[key][1] for key in got] == [[], [], [], []]
    assert got["actual_token_ids"][2] == [[6]]
    assert got == reference(seqs, [0, 2, 0], 3)


def test_top_logprobs_zero_gives_empty_top_rows_and_the_actual_tokens(
    client: TeacherClient,
) -> None:
    seqs = sequences(2, 3, 4, seed=1)
    got = client.get_sequence_logprobs(seqs, [3, 3], top_logprobs=0)
    assert got == reference(seqs, [3, 3], 0)
    assert got["logprobs"] == [[[]] * 4] * 2


def test_actual_token_ids_are_the_callers_own_objects_as_trls(client: TeacherClient) -> None:
    # TRL's client gives [sequence[p]]: the same int objects, no copies (memory, CPU)
    seqs = sequences(2, 4, 6, seed=5)
    assert max(seqs[0][4:]) > 256  # beyond CPython's cached small ints
    got = client.get_sequence_logprobs(seqs, [4, 2], top_logprobs=1)
    for seq, p, ids in zip(seqs, [4, 2], got["actual_token_ids"], strict=True):
        assert len(ids) == len(seq) - p
        assert all(row[0] is seq[p + t] for t, row in enumerate(ids))


def test_an_empty_batch_gives_empty_lists(client: TeacherClient) -> None:
    assert client.get_sequence_logprobs([], []) == {
        "logprobs": [],
        "logprob_token_ids": [],
        "actual_logprobs": [],
        "actual_token_ids": [],
    }


@pytest.mark.parametrize("temperature", [0.7, 2.0, 0.0, -1.0])
def test_a_temperature_other_than_one_is_refused_saying_why(
    client: TeacherClient, temperature: float
) -> None:
    with pytest.raises(ConfigError, match="raw logits") as info:
        client.get_sequence_logprobs([[1, 2, 3]], [1], temperature=temperature)
    assert "divides the student's logits" in str(info.value)


def test_chunk_size_and_concurrency_are_accepted_and_change_nothing(
    client: TeacherClient,
) -> None:
    seqs = sequences(3, 4, 3, seed=2)
    plain = client.get_sequence_logprobs(seqs, [4, 4, 4], top_logprobs=2, temperature=1)
    chunked = client.get_sequence_logprobs(
        seqs, [4, 4, 4], top_logprobs=2, chunk_size=1, max_concurrent_requests=1
    )
    assert plain == chunked == reference(seqs, [4, 4, 4], 2)


@pytest.mark.parametrize(
    ("seqs", "lengths", "error", "match"),
    [
        ([[1, 2], [3, 4]], [1], ValueError, "2 sequences but 1 prompt_lengths"),
        ([[1, 2], []], [1, 0], InvalidSampleError, r"sequences: \[1\] is empty"),
        ([[1, 2, 3]], [4], InvalidSampleError, r"\[0\] = 4, outside \[0, 3\]"),
        ([[1, 2, 3]], [-1], InvalidSampleError, r"\[0\] = -1, outside"),
        ([[1, 2, 3]], [1.5], InvalidSampleError, "must be an integer"),
        ([[1, 2.5, 3]], [1], InvalidSampleError, r"\[0\] must be a list of integer token ids"),
        ([[1, 2], [[1, 2], [3, 4]]], [1, 1], InvalidSampleError, r"\[1\] must be a list of"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_sent(
    client: TeacherClient, server: Any, seqs: Any, lengths: Any, error: type, match: str
) -> None:
    before = server.stats[0].requests
    with pytest.raises(error, match=match):
        client.get_sequence_logprobs(seqs, lengths, top_logprobs=1)
    assert server.stats[0].requests == before


@pytest.mark.parametrize("k", [-1, True, 2.0])
def test_a_bad_top_logprobs_is_refused(client: TeacherClient, k: Any) -> None:
    with pytest.raises(ConfigError, match="top_logprobs must be an integer >= 0"):
        client.get_sequence_logprobs([[1, 2, 3]], [1], top_logprobs=k)


def test_failed_sequences_raise_one_error_naming_how_many_and_why(
    client: TeacherClient,
) -> None:
    good = sequences(3, 3, 3, seed=3)
    bad = [1, 2, V + 5, 4]  # an id outside the teacher's vocabulary: the server answers 400
    with pytest.raises(SequenceScoringError) as info:
        client.get_sequence_logprobs([good[0], bad, good[1], bad, good[2]], [3, 2, 3, 1, 3])
    err = info.value
    assert sorted(err.failures) == [1, 3]
    assert err.total == 5
    assert str(err).startswith("2 of 5 sequences could not be scored by the teacher: 2 ")
    assert "sequence 1:" in str(err)
    # the client goes on: the next call is answered
    assert client.get_sequence_logprobs(good, [3, 3, 3], top_logprobs=1) == reference(
        good, [3, 3, 3], 1
    )


def test_replica_urls_share_the_calls(server: Any) -> None:
    with (
        mock_in_thread(lambda: serve_mock("teacher", 0, replicas=2, options=OPTIONS)) as pair,
        TeacherClient(pair.urls, environ={}) as client,
    ):
        seqs = sequences(16, 8, 4, seed=4)
        got = client.get_sequence_logprobs(seqs, [8] * 16, top_logprobs=2)
        assert got == reference(seqs, [8] * 16, 2)
        assert all(stats.generate_items > 0 for stats in pair.stats)


def test_the_teacher_comes_from_the_environment_when_no_url_is_given(server: Any) -> None:
    env = {"OPD_STREAM_TEACHERS": server.url, "OPD_STREAM_MAX_ATTEMPTS": "2"}
    with TeacherClient(environ=env) as client:
        assert client.config.max_attempts == 2
        assert client.get_sequence_logprobs([[1, 2, 3]], [1], top_logprobs=1) == reference(
            [[1, 2, 3]], [1], 1
        )


@pytest.mark.parametrize("name", ["TOP_K", "STRATEGY", "TAIL"])
def test_loss_settings_in_the_environment_are_refused(name: str) -> None:
    env = {"OPD_STREAM_TEACHERS": "http://127.0.0.1:9", f"OPD_STREAM_{name}": "1"}
    with pytest.raises(ConfigError, match=f"OPD_STREAM_{name} set, but with TRL"):
        TeacherClient(environ=env)


def test_a_config_with_several_teachers_is_refused() -> None:
    cfg = StreamConfig(teachers={"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:8"})
    with pytest.raises(ConfigError, match="one teacher"):
        TeacherClient(config=cfg)


def test_close_joins_the_loop_thread_and_a_closed_client_refuses_calls(server: Any) -> None:
    client = TeacherClient(server.url, environ={})
    thread = client._loop.thread
    assert thread.is_alive() and not thread.daemon
    client.get_sequence_logprobs([[1, 2, 3]], [1], top_logprobs=1)
    client.close()
    assert not thread.is_alive()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        client.get_sequence_logprobs([[1, 2, 3]], [1])
    assert thread not in threading.enumerate()


def test_a_client_never_closed_does_not_keep_the_interpreter_alive(server: Any) -> None:
    code = (
        "from opd_stream.integrations.trl import TeacherClient\n"
        f"c = TeacherClient({server.url!r}, environ={{}})\n"
        "r = c.get_sequence_logprobs([[1, 2, 3]], [1], top_logprobs=1)\n"
        "print(len(r['logprobs'][0]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "2\n"


def test_a_teacher_that_does_not_answer_in_time_fails_the_call_after_the_deadline() -> None:
    slow = MockOptions(vocab_size=V, head_size=HEAD, latency_fixed_s=60.0)
    with mock_in_thread(lambda: serve_mock("teacher", 0, options=slow)) as server:
        cfg = StreamConfig(teachers=server.url, request_deadline_s=0.3)
        with TeacherClient(config=cfg) as client:
            with pytest.raises(SequenceScoringError, match="2 of 2 sequences") as info:
                client.get_sequence_logprobs(sequences(2, 3, 3, seed=6), [3, 3], top_logprobs=1)
    assert {type(e).__name__ for e in info.value.failures.values()} == {"DeadlineExceeded"}
