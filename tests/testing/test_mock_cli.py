"""The mock server's command (``python -m opd_stream.testing.mock_sglang``), issue 32: its
``--vocab-size`` and ``--byte-model-*`` flags say what they do, and its default vocabulary
takes the ids of every tokenizer the README names (Qwen 3.5: 248,070 ids)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from support.cli import ROOT, subprocess_env

from opd_stream.testing.mock_sglang import MockOptions, options_to_argv
from opd_stream.testing.mock_sglang.__main__ import build_parser
from opd_stream.testing.mock_sglang.__main__ import main as mock_main
from opd_stream.testing.mock_sglang._options import CLI_VOCAB_SIZE


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("asyncio", {"debug": True})  # aiohttp


#: The vocabularies the README names with their sizes that are not in ``.cache/xtok``.
_LLAMA_3 = 128_256


def test_the_help_says_what_the_vocabulary_and_byte_model_flags_do() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--vocab-size V token ids accepted: [0, V); others are answered 400" in text
    assert "--byte-model-tokenizer PATH serve sampled-token logprobs from a ByteModel" in text
    assert "--byte-model-q BYTE_MODEL_Q the ByteModel's geometric ratio q in (0, 1)" in text
    assert "--byte-model-salt BYTE_MODEL_SALT the ByteModel's salt" in text


def test_the_default_vocabulary_holds_every_tokenizer_the_readme_names() -> None:
    xtok = pytest.importorskip("support.xtok_vocabs")  # needs the [xtok] extra
    sizes = {
        family: xtok.tokenizers.Tokenizer.from_file(
            str(Path(xtok.family_dir(family)) / "tokenizer.json")
        ).get_vocab_size(with_added_tokens=True)
        for family in xtok.FAMILIES
    }
    assert sizes["qwen-3.5"] == 248_070  # the largest
    default = build_parser().parse_args([]).vocab_size
    assert default >= max([*sizes.values(), _LLAMA_3]), (default, sizes)
    assert MockOptions().vocab_size == 151_936  # Python's default stays Qwen 2.5 / 3's


async def test_the_command_answers_the_last_id_of_qwen_3_5_by_default(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "opd_stream.testing.mock_sglang", "--port", "0"]
    async with await anyio.open_process(cmd, env=subprocess_env(), cwd=ROOT) as proc:
        try:
            assert proc.stdout is not None
            line = b""
            with anyio.fail_after(120):  # far from the ~1 s a start takes
                while not line.endswith(b"\n"):
                    line += await proc.stdout.receive(1)
            url = line.decode().removeprefix("listening on ").strip()
            body = {"input_ids": [1, 248_069], "return_logprob": True, "logprob_start_len": 0}
            body["sampling_params"] = {"max_new_tokens": 0}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{url}/generate", json=body) as resp,
            ):
                answer = await resp.text()
                assert resp.status == 200, answer
            rows = json.loads(answer)["meta_info"]["input_token_logprobs"]
            assert [row[1] for row in rows] == [1, 248_069]
        finally:
            proc.terminate()


def test_a_byte_model_tokenizer_larger_than_the_vocabulary_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    xtok = pytest.importorskip("support.xtok_vocabs")
    path = xtok.write_small(tmp_path, "a")  # a small trained tokenizer: 401 ids
    assert xtok.small_vocab("a").size == 401
    assert mock_main(["--byte-model-tokenizer", path, "--vocab-size", "400"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: --byte-model-tokenizer: its 401 ids do not fit --vocab-size 400"
    ]


def test_a_byte_model_tokenizer_that_does_not_load_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokenizer.json").write_text("not json")
    assert mock_main(["--byte-model-tokenizer", str(tmp_path / "tokenizer.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --byte-model-tokenizer: ")


def test_a_mock_process_serves_the_vocabulary_of_its_options() -> None:
    # the command's default differs from MockOptions': a MockProcess passes it on
    assert options_to_argv(MockOptions()) == ["--vocab-size", "151936"]
    assert options_to_argv(MockOptions(vocab_size=CLI_VOCAB_SIZE)) == []
    args = build_parser().parse_args(options_to_argv(MockOptions(head_size=64)))
    assert (args.vocab_size, args.head_size) == (151_936, 64)
