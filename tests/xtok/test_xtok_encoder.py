"""The exact fast encoder (tiktoken built from a tokenizer.json): the same ids as
``tokenizers`` for every text, or not used at all."""

from __future__ import annotations

import copy
import json
import random
import sys
import unicodedata
from typing import Any

import numpy as np
import pytest
from support.xtok_vocabs import FAMILIES, family_vocab, small_json, small_vocab

from opd_stream.xtok import _encoder
from opd_stream.xtok._align import align_response
from opd_stream.xtok._vocab import Vocab, byte_symbols, vocab_from_json

pytest.importorskip("tiktoken", reason="tiktoken (the optional fast encoder) is not installed")

# code point ranges the random texts draw from: scripts, CJK and its punctuation, emoji
# and their modifiers, digits of other scripts, marks, controls, private use, and the
# whole code space (characters new to one Unicode version or another)
POOLS = [
    range(0x20, 0x7F),
    range(0x80, 0x250),
    range(0x300, 0x370),
    range(0x370, 0x500),
    range(0x590, 0x700),
    range(0x660, 0x66A),
    range(0x900, 0x980),
    range(0xE00, 0xE80),
    range(0x1800, 0x1810),
    range(0x2000, 0x2070),
    range(0x2460, 0x2500),
    range(0x3000, 0x3100),
    range(0x4E00, 0x9FFF),
    range(0xAC00, 0xD7A3),
    range(0xE000, 0xE010),
    range(0xF900, 0xFB00),
    range(0xFE00, 0xFE10),
    range(0xFF00, 0xFFEF),
    range(0x1D400, 0x1D800),
    range(0x1F300, 0x1FB00),
    range(0x20000, 0x20100),
    range(0x20),
    range(0xD800),
    range(0xE000, 0x110000),
]
SPACES = [" ", "  ", "   ", "\n", "\r\n", "\t", " \n ", "\n\n", "\u00a0", "\u3000", "\u2028"]
PIECES = [
    "hello",
    " world",
    "123",
    "4567890",
    "'s",
    "'LL",
    "def",
    "(x)",
    "==",
    "你好",
    "テキスト・データ",
    "ゞ",
    "\u200d",
    "👨\u200d👩\u200d👧",
    "❤️",
    "🇫🇷",
    "👍🏽",
    "<think>",
    "</think>",
    "<\uff5cUser\uff5c>",
    "<|im_end|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "٣٤٥",
    "²³",
    "Ⅻ",
    "\u3007",
    "e\u0301",
    "\u3099か",
    "!a",
    ".Net",
    "...",
    "\x00",
    "\x7f",
    "\x85",
]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.35:
                pool = rng.choice(POOLS)
                chars = (chr(rng.choice(pool)) for _ in range(rng.randint(1, 6)))
                parts.append("".join(c for c in chars if not 0xD800 <= ord(c) < 0xE000))
            elif r < 0.55:
                parts.append(rng.choice(SPACES))
            else:
                parts.append(rng.choice(PIECES))
        out.append("".join(parts))
    return out


def assert_same_ids(vocab: Vocab, texts: list[str]) -> int:
    """Every text the fast encoder takes gets ``tokenizers``' ids; how many it took."""
    assert vocab.fast is not None
    taken = 0
    for text in texts:
        got = vocab.fast.encode(text)
        if got is None:
            continue
        taken += 1
        assert got.tolist() == vocab.encode_reference(text).tolist(), repr(text)
        assert got.dtype == np.int64
    return taken


@pytest.mark.parametrize("family", FAMILIES)
def test_each_real_family_gets_the_fast_encoder(family: str) -> None:
    assert family_vocab(family).encoder == "tiktoken"


@pytest.mark.parametrize("family", ["deepseek-v3", "glm-4.7-flash"])
def test_the_fast_encoder_gives_tokenizers_ids_on_random_multilingual_text(family: str) -> None:
    texts = random_texts(1500, seed=hash(family) % 1000)
    assert assert_same_ids(family_vocab(family), texts) == len(texts)


def test_the_fast_encoder_gives_tokenizers_ids_on_long_mixed_text() -> None:
    text = "".join(random_texts(200, seed=3))
    for family in FAMILIES:
        assert_same_ids(
            family_vocab(family), [text, text * 3, "\n".join(_encoder.CHECK_TEXTS) * 20]
        )


def test_an_nfc_normaliser_takes_only_text_already_nfc() -> None:
    qwen = family_vocab("qwen-3.5")  # normaliser: NFC
    texts = random_texts(1500, seed=5)
    taken = assert_same_ids(qwen, texts)
    assert 0 < taken < len(texts)
    decomposed = "cafe\u0301 and e\u0301"
    assert qwen.fast is not None and qwen.fast.encode(decomposed) is None
    # Vocab.encode falls back to tokenizers for it (which normalises it)
    assert qwen.encode(decomposed).tolist() == qwen.encode_reference(decomposed).tolist()
    assert qwen.encode(unicodedata.normalize("NFC", decomposed)).tolist() == (
        qwen.encode_reference(decomposed).tolist()
    )


def test_a_gpt2_byte_level_tokenizer_converts_exactly() -> None:
    # the small trained tokenizers: ByteLevel with its own regex, an added special token
    # (text here) and a non-special one (<think>, cut out first)
    for which in ("a", "b"):
        vocab = small_vocab(which)
        assert vocab.encoder == "tiktoken"
        texts = [*random_texts(500, seed=11), "<think>x</think> <|end|><think>", "<s>"]
        assert assert_same_ids(vocab, texts) == len(texts)


@pytest.mark.parametrize("family", ["deepseek-v3", "glm-4.7-flash", "qwen-3.5"])
def test_alignment_is_the_same_with_either_encoder(family: str) -> None:
    student = family_vocab("qwen-3.5")
    fast = family_vocab(family)
    slow = copy.copy(fast)
    slow.fast = None
    assert slow.encoder == "tokenizers"
    for text in random_texts(60, seed=7):
        text = unicodedata.normalize("NFC", text)
        ids = student.encode_reference(text)
        if ids.shape[0] == 0:
            continue
        a, b = align_response(student, fast, ids, "t"), align_response(student, slow, ids, "t")
        for field in a.__struct_fields__:
            assert np.array_equal(getattr(a, field), getattr(b, field)), field


# --------------------------------------------------------------- what does not convert


def _json(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(small_json("a"))
    data.update(changes)
    return data


def _load(data: dict[str, Any]) -> Vocab:
    return vocab_from_json("teacher_tokenizers[t]", "<test>", json.dumps(data))


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "Lowercase"}},
        {"normalizer": {"type": "NFKC"}},
        {
            "pre_tokenizer": {
                "type": "Sequence",
                "pretokenizers": [
                    {
                        "type": "Split",
                        "pattern": {"Regex": r"\s+"},
                        "behavior": "Removed",
                        "invert": False,
                    },
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": True,
                        "use_regex": False,
                    },
                ],
            }
        },
        {
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            }
        },
    ],
    ids=["lowercase", "nfkc", "split-removed", "prefix-space"],
)
def test_a_shape_not_known_to_convert_keeps_tokenizers(change: dict[str, Any]) -> None:
    vocab = _load(_json(**change))
    assert vocab.encoder == "tokenizers"
    assert vocab.encode("some text 12").tolist() == vocab.encode_reference("some text 12").tolist()


def test_a_model_with_byte_fallback_or_dropout_keeps_tokenizers() -> None:
    for key, value in (("byte_fallback", True), ("dropout", 0.5)):
        data = _json()
        data["model"][key] = value
        assert _load(data).encoder == "tokenizers", key


def _tiny(merges: list[tuple[str, str]], *, ignore_merges: bool = False) -> dict[str, Any]:
    """A byte-level BPE over the 256 byte symbols plus what ``merges`` make."""
    symbols = sorted(byte_symbols().items(), key=lambda kv: kv[1])
    vocab = {ch: i for i, (ch, _) in enumerate(symbols)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    data = _json()
    data["added_tokens"] = []
    data["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": ignore_merges,
        "vocab": vocab,
        "merges": [f"{left} {right}" for left, right in merges],
    }
    return data


def test_an_entry_its_own_symbols_do_not_merge_into_keeps_tokenizers() -> None:
    # "abc" is made by (ab, c), but (b, c) ranks first: tokenizers gives "abc" as a + bc,
    # while tiktoken would take the piece "abc" as the entry "abc"
    data = _tiny([("b", "c"), ("a", "b"), ("ab", "c")])
    vocab = _load(data)
    assert vocab.encoder == "tokenizers"
    assert [vocab.token_bytes[i] for i in vocab.encode("abc").tolist()] == [b"a", b"bc"]
    # the same merges in a consistent order convert
    assert _load(_tiny([("a", "b"), ("b", "c"), ("ab", "c")])).encoder == "tiktoken"


def test_an_entry_made_again_after_others_keeps_tokenizers() -> None:
    # (a, bc) makes "abc" again after "xy" was made in between: ranks would not say the
    # order tokenizers merges in
    data = _tiny([("a", "b"), ("b", "c"), ("ab", "c"), ("x", "y"), ("a", "bc")])
    assert _load(data).encoder == "tokenizers"
    # made again right after (as files converted from tiktoken list them): converts
    data = _tiny([("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("x", "y")])
    vocab = _load(data)
    assert vocab.encoder == "tiktoken"
    assert_same_ids(vocab, ["abc abcabc xabcy bcab", *random_texts(100, seed=2)])


def test_a_non_special_added_token_inside_another_keeps_tokenizers() -> None:
    data = _json()
    top = max(int(a["id"]) for a in data["added_tokens"])
    data["added_tokens"] += [
        {
            "id": top + 1,
            "content": "<x>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        },
        {
            "id": top + 2,
            "content": "<<x>>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        },
    ]
    assert _load(data).encoder == "tokenizers"


def test_the_check_corpus_refuses_a_wrong_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSeek's three Split regexes naively joined into one alternation give other pieces
    # (a CJK run with its punctuation, spaces before a digit, ...): the check catches it
    path = family_vocab("deepseek-v3").path
    with open(path, encoding="utf-8") as f:
        text = f.read()
    steps = json.loads(text)["pre_tokenizer"]["pretokenizers"]
    naive = "|".join(s["pattern"]["Regex"] for s in steps if s["type"] == "Split")
    monkeypatch.setattr(_encoder, "pre_tokenizer_regex", lambda pre: naive)
    assert vocab_from_json("teacher_tokenizers[t]", path, text).encoder == "tokenizers"


def test_without_tiktoken_tokenizers_encodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    vocab = vocab_from_json("student_tokenizer", "<a>", small_json("a"))
    assert vocab.encoder == "tokenizers"
    assert vocab.encode("hello <think> world").tolist() == (
        vocab.encode_reference("hello <think> world").tolist()
    )


@pytest.mark.parametrize("regex", [r"\p{L}+| ?\p{N}{1,3}", _encoder._GPT2])
def test_a_split_keeping_only_its_matches_converts_exactly(regex: str) -> None:
    # MiniMax's shape: Split(behavior Removed, invert): the matches are the pieces, the
    # rest is dropped, as tiktoken drops it
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Removed", "invert": True}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False}  # fmt: skip
    vocab = _load(_json(pre_tokenizer={"type": "Sequence", "pretokenizers": [split, level]}))
    assert vocab.encoder == "tiktoken"
    texts = [*random_texts(300, seed=13), "abc 123 !!! def", "  \n\t"]
    assert assert_same_ids(vocab, texts) == len(texts)
