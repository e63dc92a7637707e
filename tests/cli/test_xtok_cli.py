"""``opd-stream score`` with a teacher of another tokenizer: ``--student-tokenizer``,
``--teacher-tokenizer NAME=PATH``, ``--with-alignment``, and ``prompt_messages`` rendered
with the teacher's chat template (DeepSeek V3's, from its tokenizer_config.json)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.cli import run_cli
from support.xtok_vocabs import family_dir, family_vocab, small_json, small_vocab, write_small
from tokenizers import Tokenizer, models

from opd_stream import InvalidSampleError
from opd_stream.cli._main import main
from opd_stream.cli._score_schema import decode_line
from opd_stream.testing.mock_sglang import ByteModel, MockOptions, serve_mock
from opd_stream.xtok._chat import ChatTemplate

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Say hello in three scripts 🎉"},
]
RESPONSE = "Hello, 你好, Привет! 🎉"


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # serve_mock runs on asyncio


pytestmark = pytest.mark.usefixtures("cli_env")


@pytest.fixture(scope="module")
def ds_template() -> Iterator[ChatTemplate]:
    """DeepSeek V3's chat template (from its tokenizer_config.json), loaded once for the
    module: its process loads the tokenizer (~2 s)."""
    template = ChatTemplate.load("t", family_dir("deepseek-v3"))
    try:
        yield template
    finally:
        template.close()


def test_the_teacher_chat_templates_render_and_encode_their_special_tokens(
    ds_template: ChatTemplate,
) -> None:
    ds = ds_template
    text = ds.render(MESSAGES)
    assert text.startswith(ds.tokens["bos_token"]) and text.endswith("<｜Assistant｜>")  # noqa: RUF001
    ids = ds.prompt_ids(MESSAGES).tolist()
    ds_tokenizer = family_vocab("deepseek-v3").tokenizer
    assert ds_tokenizer is not None
    assert ids[0] == ds_tokenizer.token_to_id(ds.tokens["bos_token"])
    assert ids[-1] == ds_tokenizer.token_to_id("<｜Assistant｜>")  # noqa: RUF001
    glm = ChatTemplate.load("t", family_dir("glm-4.7-flash"))  # from chat_template.jinja
    ids = glm.prompt_ids(MESSAGES).tolist()
    glm_tokenizer = family_vocab("glm-4.7-flash").tokenizer
    assert glm_tokenizer is not None
    assert ids[0] == glm_tokenizer.token_to_id("[gMASK]")
    assert glm_tokenizer.decode(ids, skip_special_tokens=False) == glm.render(MESSAGES)
    glm.close()


async def test_score_with_a_deepseek_teacher_from_prompt_messages(
    tmp_path: Path, ds_template: ChatTemplate
) -> None:
    # the student's tokenizer: a small trained one (the teacher's is what this is about; a
    # real student's would only add a ~3 s load to the command's start)
    student = small_vocab("a")
    teacher = family_vocab("deepseek-v3", "teacher_tokenizers[ds]")
    s_model = ByteModel(student.token_bytes, q=0.5)
    t_model = ByteModel(teacher.token_bytes, q=0.6, salt=9)
    student_prompt = student.encode("Say hello in three scripts 🎉\n").tolist()
    response = student.encode(RESPONSE).tolist()
    tokens = np.array(student_prompt + response)
    rollout = s_model.token_logprobs(tokens, np.arange(len(student_prompt), tokens.shape[0]))
    base = {
        "prompt_ids": student_prompt,
        "response_ids": response,
        "rollout_logprobs": [float(np.float32(x)) for x in rollout],
    }
    lines = [
        {"id": "messages", **base, "prompt_messages": MESSAGES},
        {"id": "string", **base, "prompt_messages": "Say hello in three scripts 🎉"},
        {"id": "both", **base, "prompt_messages": MESSAGES, "teacher_prompt_ids": [1]},
        {"id": "none", **base},
        {"id": "shared", **base, "teacher": "same", "prompt_messages": MESSAGES},
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    opts = MockOptions(vocab_size=262144)
    async with serve_mock("teacher", 1, options=opts, byte_model=t_model) as server:
        argv = [
            "--log-level", "warning", "score",
            "--teacher", f"ds={server.url}",
            "--teacher", f"same={server.url}",
            "--student-tokenizer", write_small(tmp_path, "a"),
            "--teacher-tokenizer", f"ds={family_dir('deepseek-v3')}",
            "--with-alignment",
            "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"),
            "--no-progress",
        ]  # fmt: skip
        code = await run_cli(*argv)
    assert code == 0
    out = {x["id"]: x for x in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    template = ds_template  # the command loads its own from the same file
    for key, messages in (("messages", MESSAGES), ("string", "Say hello in three scripts 🎉")):
        got = out[key]
        assert got["ok"] is True, got
        chat = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        history = teacher.join(template.prompt_ids(chat))  # what the teacher was sent
        student_history = student.join(np.array(student_prompt))
        ls = s_model.byte_logprobs(RESPONSE.encode(), history=student_history)
        lt = t_model.byte_logprobs(RESPONSE.encode(), history=history)
        al = got["alignment"]
        spans, offsets = al["student_spans"], al["span_bytes"]
        assert teacher.join(np.array(al["teacher_ids"])) == RESPONSE.encode()
        expected = [0.0] * len(response)
        for j in range(len(spans) - 1):
            a, b = offsets[j], offsets[j + 1]
            expected[spans[j + 1] - 1] = math.fsum(ls[a:b]) - math.fsum(lt[a:b])
        np.testing.assert_allclose(got["reverse_kl"], expected, rtol=0, atol=2e-4)
    assert out["both"]["ok"] is False and "not both" in out["both"]["message"]
    assert out["none"]["reason"] == "invalid_sample"
    assert out["none"]["message"].startswith("teacher_prompt_ids: required: teacher 'ds'")
    assert "prompt_messages" in out["none"]["message"]  # what a line of the command can give
    assert out["shared"]["ok"] is False
    assert "teacher 'same' has no tokenizer of its own" in out["shared"]["message"]


# --- issue 32: a tokenizer file that does not load; the missing teacher prompt --------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not a readable tokenizer.json (Expecting value"),
        (  # a model type the tokenizers library does not know
            json.dumps({"version": "1.0", "model": {"type": "Unknown", "vocab": {}}}),
            "not a readable tokenizer.json (",
        ),
        (  # a model the library reads, but not a byte-level BPE
            Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str(),
            "only byte-level BPE tokenizers are supported",
        ),
    ],
    ids=["not-json", "unknown-model-type", "word-level"],
)
def test_a_tokenizer_file_that_does_not_load_is_one_line_and_exit_2_before_the_output_is_touched(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "student.json").write_text(small_json("a"))
    (tmp_path / "teacher.json").write_text(text)
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(b'{"an earlier": "run"}\n')
    for output in (kept, tmp_path / "new.jsonl"):
        argv = ["score", "--teacher", "t=http://127.0.0.1:9", "--no-progress"]
        argv += ["--student-tokenizer", str(tmp_path / "student.json")]
        argv += ["--teacher-tokenizer", f"t={tmp_path / 'teacher.json'}"]
        argv += ["--input", str(tmp_path / "in.jsonl"), "--output", str(output)]
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.splitlines()
        prefix = f"opd-stream score: error: configuration: teacher_tokenizers[t]: {tmp_path}"
        assert line.startswith(prefix) and message in line, line
    assert kept.read_bytes() == b'{"an earlier": "run"}\n'
    assert not (tmp_path / "new.jsonl").exists()


def test_a_line_without_the_teacher_prompt_names_prompt_messages() -> None:
    line = b'{"prompt_ids": [1, 2], "response_ids": [3], "teacher": "ds"}'
    with pytest.raises(InvalidSampleError) as info:
        decode_line(line, line=1, seq=0, own_tokenizer=frozenset({"ds"}))
    assert info.value.reason == "invalid_sample" and info.value.field == "teacher_prompt_ids"
    assert "prompt_messages" in str(info.value) and "teacher_prompt_ids" in str(info.value)
    # a teacher that shares the student's tokenizer needs neither
    sample = decode_line(line.replace(b'"ds"', b'"same"'), line=1, seq=0, own_tokenizer={"ds"})
    assert sample.teacher_prompt_ids is None
