"""A stream's tokenizers load and encode in a process of their own
(``python -m opd_stream.xtok._worker``): the same tables and ids as the tokenizer loaded
in-process, the same load errors, and the process stopped with the stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.config import stream_config
from support.xtok_vocabs import (
    SPECIAL,
    family_dir,
    family_vocab,
    small_json,
    small_vocab,
    write_small,
)

import opd_stream
from opd_stream import ConfigError, OPDStream, Sample, SampleFailure
from opd_stream.testing.inprocess import InProcessSGLang, mock_transport
from opd_stream.xtok._process import EncoderError
from opd_stream.xtok._vocab import Vocab, load_vocab_process, vocab_from_json

TEXTS = [
    "Hello, world! Größe café naïve — Zürich façade. 12345 + 678 = 13023.",
    "東京と北京、你好世界。Ελληνικά русский язык עברית العربية हिन्दी",
    "e\u0301 and A\u030a: not NFC (tokenizers itself encodes these for an NFC normaliser)",
    "<|im_end|><|endoftext|><think> special-token strings are text </think>\n\n",
    "emoji 🎉🎉 👍🏽 ❤️ 🇫🇷 👨\u200d👩\u200d👧 \x00\x01\x7f " * 40,
    "",
]


def _same(local: Vocab, remote: Vocab) -> None:
    assert remote.size == local.size
    assert remote.token_bytes == local.token_bytes
    np.testing.assert_array_equal(remote.lengths, local.lengths)
    np.testing.assert_array_equal(remote.textless, local.textless)
    assert remote.special_texts() == local.special_texts()
    assert remote.encoder == local.encoder
    # the byte tables a join reads (built from the process's packed answer)
    ids = np.random.default_rng(0).integers(0, local.size, 4000)
    assert remote.join(ids) == local.join(ids) == b"".join(local.token_bytes[i] for i in ids)
    for text in TEXTS:
        assert remote.encode(text).tolist() == local.encode(text).tolist(), text
        assert remote.encode_reference(text).tolist() == local.encode_reference(text).tolist()


@pytest.mark.parametrize("family", ["qwen-3.5", "deepseek-v3", "glm-4.7-flash"])
def test_a_real_tokenizer_in_its_process_has_the_in_process_tables_and_ids(family: str) -> None:
    local = family_vocab(family)
    remote = load_vocab_process("student_tokenizer", family_dir(family))
    try:
        assert remote.tokenizer is None and remote.process is not None
        assert remote.encoder == "tiktoken" and remote.path == local.path
        _same(local, remote)
    finally:
        remote.close()
    assert remote.process is not None and not remote.process.running


def test_a_tokenizer_without_a_fast_encoder_encodes_as_in_process(tmp_path: Path) -> None:
    data = json.loads(small_json("a"))
    data["normalizer"] = {"type": "Lowercase"}  # no tiktoken equivalent: tokenizers encodes
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    local = vocab_from_json("student_tokenizer", str(path), path.read_text(encoding="utf-8"))
    remote = load_vocab_process("student_tokenizer", str(path))
    try:
        assert local.encoder == "tokenizers"
        _same(local, remote)
    finally:
        remote.close()


def test_a_file_that_does_not_load_is_a_config_error_naming_setting_and_path(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_vocab_process("teacher_tokenizers[ds]", str(tmp_path))
    message = str(caught.value)
    assert message.startswith(f"teacher_tokenizers[ds]: {path}: not a readable tokenizer.json")


def test_a_worker_that_died_is_an_encoder_error_naming_the_setting(tmp_path: Path) -> None:
    vocab = load_vocab_process("teacher_tokenizers[t]", write_small(tmp_path, "b"))
    assert vocab.process is not None
    os.kill(vocab.process._proc.pid, signal.SIGKILL)
    with pytest.raises(EncoderError, match=r"teacher_tokenizers\[t\]: .*exited \(code -9\)"):
        vocab.encode("hello")
    vocab.close()


def test_a_worker_exits_when_its_input_closes_and_ignores_ctrl_c(tmp_path: Path) -> None:
    vocab = load_vocab_process("student_tokenizer", write_small(tmp_path, "a"))
    assert vocab.process is not None
    proc = vocab.process._proc
    os.kill(proc.pid, signal.SIGINT)  # the host's Ctrl-C reaches its process group
    assert vocab.encode("hello world").tolist() == small_vocab("a").encode("hello world").tolist()
    assert proc.stdin is not None
    proc.stdin.close()  # as when the host's process ends, however it ends
    assert proc.wait(30) == 0
    vocab.close()


def _stream_and_sample(tmp_path: Path) -> tuple[OPDStream, Sample]:
    t = "http://teacher:1"
    cfg = stream_config(
        t,
        student_tokenizer=write_small(tmp_path, "a"),
        teacher_tokenizers={"default": write_small(tmp_path, "b")},
    )
    student, teacher = small_vocab("a"), small_vocab("b", "teacher_tokenizers[default]")
    assert student.tokenizer is not None
    end = student.tokenizer.token_to_id(SPECIAL)
    prompt, text = student.encode("Question: "), student.encode("hello world")
    sample = Sample(
        tokens=[*prompt.tolist(), *text.tolist(), end],
        response_length=int(text.shape[0]) + 1,
        rollout_logprobs=[-1.0] * (int(text.shape[0]) + 1),
        teacher_prompt_ids=teacher.encode("Question: ").tolist(),
    )
    server = InProcessSGLang("teacher", 1, vocab_size=4096)
    return OPDStream(cfg, transport=mock_transport({t: server})), sample


@pytest.mark.anyio
async def test_a_streams_tokenizer_processes_stop_as_it_ends(
    tmp_path: Path, anyio_backend: str
) -> None:
    stream, sample = _stream_and_sample(tmp_path)
    async with stream:
        assert stream._parts is not None
        xtok = stream._parts.fetcher.xtok
        assert xtok is not None
        processes = [v.process for v in (xtok.student, *xtok.teachers.values())]
        assert len(processes) == 2 and all(p is not None and p.running for p in processes)
        scored = await stream.score(sample)
        assert scored.reverse_kl is not None, scored
    assert all(p is not None and not p.running for p in processes)


def test_special_token_strings_are_those_tokens_for_a_chat_templates_text() -> None:
    local = family_vocab("deepseek-v3")
    assert local.tokenizer is not None
    remote = load_vocab_process("teacher_tokenizers[ds]", family_dir("deepseek-v3"))
    assert remote.process is not None
    text = "<｜begin▁of▁sentence｜>Hi<｜User｜>Say hi 🎉<｜Assistant｜>"  # noqa: RUF001
    try:
        local.tokenizer.encode_special_tokens = False
        want = local.tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        local.tokenizer.encode_special_tokens = True
    try:
        assert remote.process.encode(text, specials=True).tolist() == want
        assert remote.encode(text).tolist() == local.encode(text).tolist() != want
    finally:
        remote.close()


def test_the_host_process_builds_no_tokenizer_of_a_stream_or_chat_template(
    tmp_path: Path,
) -> None:
    """Loading the stream's tokenizers and a teacher's chat template leaves ``tokenizers``
    and ``tiktoken`` unimported in the host: every construction holding the GIL (0.1-0.6 s
    at a stretch) runs in another process. (The stream's tokenizers are the small trained
    ones, whose worker builds a fast encoder too: a real one's size only makes the load
    longer; the chat template is DeepSeek V3's.)"""
    code = (
        "import sys\n"
        "from opd_stream import StreamConfig\n"
        "from opd_stream.xtok._tokenizers import CrossTokenizers\n"
        "from opd_stream.xtok._chat import ChatTemplate\n"
        f"config = StreamConfig.from_env({{}}, teachers='http://127.0.0.1:9',"
        f" student_tokenizer={write_small(tmp_path, 'a')!r},"
        f" teacher_tokenizers={{'default': {write_small(tmp_path, 'b')!r}}})\n"
        "xtok = CrossTokenizers.load(config.student_tokenizer, config.teacher_tokenizers)\n"
        f"chat = ChatTemplate.load('teacher_tokenizers[ds]', {family_dir('deepseek-v3')!r})\n"
        "assert xtok is not None and len(chat.prompt_ids([{'role': 'user', 'content': 'hi'}]))\n"
        "print(sorted(m for m in ('tokenizers', 'tiktoken') if m in sys.modules))\n"
        "xtok.close(); chat.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPD_STREAM_")}
    env["PYTHONPATH"] = str(Path(opd_stream.__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


@pytest.mark.anyio
async def test_samples_after_a_teachers_process_died_fail_saying_so(
    tmp_path: Path, anyio_backend: str
) -> None:
    stream, sample = _stream_and_sample(tmp_path)
    async with stream:
        assert stream._parts is not None and stream._parts.fetcher.xtok is not None
        process = stream._parts.fetcher.xtok.teachers["default"].process
        assert process is not None
        os.kill(process._proc.pid, signal.SIGKILL)
        async with stream.run([sample, sample, sample]) as results:
            got = [r async for r in results]
    assert len(got) == 3  # nothing lost: each one out, saying why
    for failure in got:
        assert isinstance(failure, SampleFailure), failure
        assert failure.reason == "encoder_failed", failure
        assert "teacher_tokenizers[default]: the tokenizer process exited" in failure.message
        assert "please report" not in failure.message  # not a bug of ours


def test_the_tokenizer_processes_start_side_by_side(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each distinct file is loaded once, all of them at the same time (a barrier that every
    load must reach before any returns: one after another, the first would wait alone)."""
    import threading

    import opd_stream.xtok._tokenizers as tokenizers

    student, teacher = write_small(tmp_path / "s", "a"), write_small(tmp_path / "t", "b")
    together = threading.Barrier(2, timeout=30)
    calls: list[str] = []
    real = tokenizers.load_vocab_process

    def load(setting: str, path: str) -> Vocab:
        calls.append(setting)
        together.wait()
        return real(setting, path)

    monkeypatch.setattr(tokenizers, "load_vocab_process", load)
    xtok = tokenizers.CrossTokenizers.load(student, {"t1": teacher, "t2": teacher})
    assert xtok is not None
    try:
        assert sorted(calls) == ["student_tokenizer", "teacher_tokenizers[t1]"]
        assert xtok.teachers["t1"] is xtok.teachers["t2"]
    finally:
        xtok.close()


def test_when_one_tokenizer_fails_to_load_the_others_are_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import opd_stream.xtok._tokenizers as tokenizers

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json", encoding="utf-8")
    started: list[Vocab] = []
    real = tokenizers.load_vocab_process

    def load(setting: str, path: str) -> Vocab:
        vocab = real(setting, path)
        started.append(vocab)
        return vocab

    monkeypatch.setattr(tokenizers, "load_vocab_process", load)
    with pytest.raises(ConfigError, match=r"teacher_tokenizers\[t\]: .*not a readable"):
        tokenizers.CrossTokenizers.load(write_small(tmp_path / "s", "a"), {"t": str(bad)})
    (student,) = started
    assert student.process is not None
    assert student.process._proc.wait(30) is not None  # stopped, not left running
