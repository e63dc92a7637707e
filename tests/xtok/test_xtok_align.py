"""Cross-tokenizer alignment (the sans-IO core): tokenizer loading, ids -> bytes, the
smallest spans with coinciding byte boundaries, the span signal and its assignment rule."""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from support.xtok_vocabs import SPECIAL, family_vocab, small_json, small_vocab, write_small

from opd_stream import ConfigError, InvalidSampleError
from opd_stream.xtok._align import Alignment, align_response, span_signal
from opd_stream.xtok._vocab import Vocab, byte_symbols, load_vocab

TEXTS = [
    "Hello, world! The quick brown fox.",
    "def square(x):\n    return x * x  # 平方\n",
    "Größe café naïve — Zürich façade",
    "東京と北京、你好世界。日本語のテキスト",
    "Ελληνικά русский язык עברית العربية हिन्दी",
    "emoji 🎉🎉 👍🏽 ❤️ 🇫🇷 family 👨‍👩‍👧 end",
    "<think>let me think</think> answer: 42",
    "tabs\tand\nnew\r\nlines   and    spaces",
]


def check_alignment(student: Vocab, teacher: Vocab, ids: np.ndarray, a: Alignment) -> None:
    """What an alignment must be, checked from its definition, span by span."""
    r = ids.shape[0]
    s_sp, t_sp = a.student_spans, a.teacher_spans
    assert s_sp[0] == 0 and s_sp[-1] == r and np.all(np.diff(s_sp) >= 1)
    assert t_sp[0] == 0 and t_sp[-1] == a.teacher_ids.shape[0] and np.all(np.diff(t_sp) >= 0)
    assert a.textless.tolist() == [student.token_bytes[i] == b"" for i in ids.tolist()]
    offset = 0
    for j in range(s_sp.shape[0] - 1):
        s_tokens = [student.token_bytes[i] for i in ids[s_sp[j] : s_sp[j + 1]].tolist()]
        t_tokens = [teacher.token_bytes[i] for i in a.teacher_ids[t_sp[j] : t_sp[j + 1]].tolist()]
        assert a.span_bytes[j] == offset
        offset += len(b"".join(s_tokens))
        if not a.scored[j]:
            continue
        # the same bytes on both sides
        assert b"".join(s_tokens) == b"".join(t_tokens)
        # the smallest such span: no inner offset is a boundary on both sides
        s_inner = set(np.cumsum([len(b) for b in s_tokens])[:-1].tolist())
        t_inner = set(np.cumsum([len(b) for b in t_tokens])[:-1].tolist())
        assert not (s_inner & t_inner) - {0}
        assert s_tokens[-1] != b"", "a scored span ends on a token with bytes"
    assert a.span_bytes[-1] == offset


# ---------------------------------------------------------------- tokenizer loading


def test_the_byte_alphabet_is_a_bijection_over_the_256_byte_values() -> None:
    table = byte_symbols()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["\u0120"] == ord(" ")  # 'Ġ' is the space


def test_a_missing_tokenizer_file_is_a_config_error_naming_setting_and_path(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"student_tokenizer: tokenizer file not found: .*nope"):
        load_vocab("student_tokenizer", missing)


def test_a_directory_without_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"teacher_tokenizers\[big\]: .*no tokenizer\.json"):
        load_vocab("teacher_tokenizers[big]", str(tmp_path))


def test_an_unreadable_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"student_tokenizer: .*not a readable tokenizer\.json"):
        load_vocab("student_tokenizer", str(tmp_path))


def test_a_tokenizer_that_is_not_byte_level_is_refused(tmp_path: Path) -> None:
    data = json.loads(small_json("a"))
    data["decoder"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError, match="only byte-level BPE tokenizers are supported"):
        load_vocab("student_tokenizer", str(tmp_path))


def test_a_directory_or_its_tokenizer_json_load_the_same(tmp_path: Path) -> None:
    d = write_small(tmp_path, "a")
    v1, v2 = load_vocab("s", d), load_vocab("s", d + "/tokenizer.json")
    assert v1.size == v2.size and v1.token_bytes == v2.token_bytes


def test_special_tokens_are_textless_and_added_tokens_are_their_text() -> None:
    v = small_vocab("a")
    end = v.tokenizer.token_to_id(SPECIAL)
    think = v.tokenizer.token_to_id("<think>")
    assert v.token_bytes[end] == b"" and v.textless[end]
    assert v.token_bytes[think] == b"<think>" and not v.textless[think]
    # every other id is bytes that the tokenizer's own decoder agrees with
    for i in range(v.size):
        if not v.textless[i] and i != think:
            text = v.tokenizer.decode([i])
            if "\ufffd" not in text:
                assert v.token_bytes[i] == text.encode("utf-8")


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize("text", TEXTS)
def test_small_tokenizers_align_span_by_span(text: str) -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b", "teacher_tokenizers[b]")
    ids = a_vocab.encode(text)
    al = align_response(a_vocab, b_vocab, ids, "b")
    check_alignment(a_vocab, b_vocab, ids, al)
    assert b_vocab.join(al.teacher_ids) == text.encode("utf-8")
    assert al.scored.all()


def test_identical_tokenizers_give_one_token_spans() -> None:
    v = small_vocab("a")
    ids = v.encode(TEXTS[2])
    al = align_response(v, v, ids, "same")
    assert al.teacher_ids.tolist() == ids.tolist()
    assert al.student_spans.tolist() == list(range(ids.shape[0] + 1))
    assert al.teacher_spans.tolist() == list(range(ids.shape[0] + 1))


def test_tokens_that_split_a_utf8_character_join_in_one_span() -> None:
    # b spells the emoji as 3 tokens that split its bytes; a has it as one token
    student, teacher = small_vocab("b"), small_vocab("a")
    ids = student.encode("x🎉y")
    assert [student.token_bytes[i] for i in ids] == [b"x", b"\xf0\x9f", b"\x8e", b"\x89", b"y"]
    al = align_response(student, teacher, ids, "a")
    check_alignment(student, teacher, ids, al)
    assert al.student_spans.tolist() == [0, 1, 4, 5]
    assert al.teacher_spans.tolist() == [0, 1, 2, 3]
    assert al.span_bytes.tolist() == [0, 1, 5, 6]


def test_both_sides_may_split_a_character_at_the_same_byte() -> None:
    student, teacher = small_vocab("b"), small_vocab("a")
    ids = student.encode(" 👍🏽")
    t_bytes = [teacher.token_bytes[i] for i in teacher.encode(" 👍🏽")]
    assert t_bytes == [b" \xf0\x9f\x91\x8d\xf0\x9f", b"\x8f\xbd"]
    al = align_response(student, teacher, ids, "a")
    check_alignment(student, teacher, ids, al)
    assert al.span_bytes.tolist() == [0, 7, 9]  # a boundary inside the skin-tone modifier
    assert al.student_spans.tolist() == [0, 4, 6] and al.teacher_spans.tolist() == [0, 1, 2]


def test_textless_tokens_at_boundaries_are_spans_without_teacher_tokens() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    end = a_vocab.tokenizer.token_to_id(SPECIAL)
    body = a_vocab.encode("quick fox")
    ids = np.concatenate([[end], body, [end, end]])
    al = align_response(a_vocab, b_vocab, ids, "b")
    check_alignment(a_vocab, b_vocab, ids, al)
    assert al.student_spans[:2].tolist() == [0, 1] and al.teacher_spans[:2].tolist() == [0, 0]
    assert al.student_spans[-2:].tolist() == [ids.shape[0] - 2, ids.shape[0]]
    assert al.teacher_spans[-2] == al.teacher_spans[-1]
    assert not al.scored[0] and not al.scored[-1] and al.scored[1:-1].all()
    assert b_vocab.join(al.teacher_ids) == b"quick fox"


def test_a_textless_token_inside_a_teacher_token_belongs_to_its_span_and_counts_zero() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    byte_id = {b: i for i, b in enumerate(a_vocab.token_bytes) if len(b) == 1}
    end = a_vocab.tokenizer.token_to_id(SPECIAL)
    word = b_vocab.encode("quick")
    assert word.shape[0] == 1, "the teacher spells 'quick' as one token"
    ids = np.array([byte_id[b"q"], byte_id[b"u"], end, *(byte_id[bytes([c])] for c in b"ick")])
    al = align_response(a_vocab, b_vocab, ids, "b")
    assert al.student_spans.tolist() == [0, 6] and al.teacher_spans.tolist() == [0, 1]
    student_lps = np.array([-1.0, -2.0, -50.0, -0.5, -0.25, -0.125], dtype=np.float32)
    teacher, rkl = span_signal(al, np.array([-3.0], np.float32), student_lps)
    assert rkl is not None
    assert rkl.tolist() == [0, 0, 0, 0, 0, (-1 - 2 - 0.5 - 0.25 - 0.125) - (-3.0)]
    assert teacher.tolist() == [0, 0, 0, 0, 0, -3.0]


def test_a_response_cut_inside_its_last_character_leaves_that_span_unscored() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    byte_id = {b: i for i, b in enumerate(a_vocab.token_bytes) if len(b) == 1}
    body = a_vocab.encode("ok ")
    cut = [byte_id[bytes([c])] for c in "🎉".encode()[:2]]
    ids = np.concatenate([body, cut])
    al = align_response(a_vocab, b_vocab, ids, "b")
    assert b_vocab.join(al.teacher_ids) == b"ok "
    assert not al.scored[-1] and al.scored[:-1].all()
    assert al.student_spans[-2] <= body.shape[0]
    lps = np.full(ids.shape[0], -1.0, np.float32)
    _, rkl = span_signal(al, np.full(al.teacher_ids.shape[0], -1.0, np.float32), lps)
    assert rkl is not None and rkl[al.student_spans[-2] :].tolist() == [0.0] * (
        ids.shape[0] - al.student_spans[-2]
    )


def test_only_textless_tokens_give_one_unscored_span() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    end = a_vocab.tokenizer.token_to_id(SPECIAL)
    al = align_response(a_vocab, b_vocab, np.array([end, end]), "b")
    assert al.teacher_ids.shape == (0,)
    assert al.student_spans.tolist() == [0, 2] and not al.scored.any()
    teacher, rkl = span_signal(al, np.zeros(0, np.float32), np.array([-1, -2], np.float32))
    assert teacher.tolist() == [0, 0] and rkl is not None and rkl.tolist() == [0, 0]


# ---------------------------------------------------------------- bad input


def test_a_response_id_outside_the_student_vocabulary_fails_naming_the_position() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    ids = np.array([5, 6, a_vocab.size + 3])
    with pytest.raises(
        InvalidSampleError,
        match=r"tokens: response token id \d+ at response "
        r"position 2 is outside the student tokenizer's vocabulary",
    ):
        align_response(a_vocab, b_vocab, ids, "b")


def test_bytes_that_are_not_utf8_fail_naming_the_byte() -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    byte_id = {b: i for i, b in enumerate(a_vocab.token_bytes) if len(b) == 1}
    ids = np.array([byte_id[b"a"], byte_id[b"\xff"], byte_id[b"b"]])
    with pytest.raises(
        InvalidSampleError,
        match=r"not UTF-8 text at byte 1 \(student token at "
        r"response position 1\)",
    ):
        align_response(a_vocab, b_vocab, ids, "b")


def test_text_the_teacher_tokenizer_does_not_round_trip_fails(tmp_path: Path) -> None:
    data = json.loads(small_json("b"))
    data["normalizer"] = {"type": "NFC"}  # like Qwen 3.5's: it recomposes "e" + U+0301
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    teacher = load_vocab("teacher_tokenizers[nfc]", str(tmp_path))
    a_vocab = small_vocab("a")
    text = unicodedata.normalize("NFD", "café")
    with pytest.raises(
        InvalidSampleError,
        match=r"teacher 'nfc'.*does not round-trip the response"
        r" text: its tokens spell other bytes from byte 3 on",
    ):
        align_response(a_vocab, teacher, a_vocab.encode(text), "nfc")


# ---------------------------------------------------------------- the span signal


def reference_signal(
    a: Alignment, teacher_lps: list[float], student_lps: list[float]
) -> tuple[list[float], list[float]]:
    """float64, per span and per token, from the documented rule."""
    r = int(a.student_spans[-1])
    teacher, rkl = [0.0] * r, [0.0] * r
    for j in range(a.scored.shape[0]):
        if not a.scored[j]:
            continue
        s0, s1 = int(a.student_spans[j]), int(a.student_spans[j + 1])
        t0, t1 = int(a.teacher_spans[j]), int(a.teacher_spans[j + 1])
        s = math.fsum(student_lps[t] for t in range(s0, s1) if not a.textless[t])
        t = math.fsum(teacher_lps[t0:t1])
        teacher[s1 - 1] = t
        rkl[s1 - 1] = s - t
    return teacher, rkl


@pytest.mark.parametrize("text", TEXTS)
def test_the_span_signal_is_the_span_sums_difference_on_the_last_student_token(text: str) -> None:
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    end = a_vocab.tokenizer.token_to_id(SPECIAL)
    ids = np.concatenate([a_vocab.encode(text), [end]])
    al = align_response(a_vocab, b_vocab, ids, "b")
    rng = np.random.default_rng(len(text))
    s_lps = -rng.exponential(2.0, ids.shape[0]).astype(np.float32)
    t_lps = -rng.exponential(2.0, al.teacher_ids.shape[0]).astype(np.float32)
    teacher, rkl = span_signal(al, t_lps, s_lps)
    ref_t, ref_r = reference_signal(al, t_lps.tolist(), s_lps.tolist())
    assert teacher.dtype == np.float32 and rkl is not None and rkl.dtype == np.float32
    np.testing.assert_allclose(teacher, ref_t, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rkl, ref_r, rtol=1e-6, atol=1e-6)
    # the sum over the response is the text's log-ratio
    assert math.isclose(float(np.sum(rkl, dtype=np.float64)), math.fsum(ref_r), abs_tol=1e-4)
    assert rkl[-1] == 0.0  # the textless end token


def test_one_token_spans_give_exactly_the_same_tokenizer_values() -> None:
    v = small_vocab("a")
    ids = v.encode(TEXTS[0])
    al = align_response(v, v, ids, "same")
    rng = np.random.default_rng(0)
    s_lps = -rng.exponential(2.0, ids.shape[0]).astype(np.float32)
    t_lps = -rng.exponential(2.0, ids.shape[0]).astype(np.float32)
    teacher, rkl = span_signal(al, t_lps, s_lps)
    assert np.array_equal(teacher, t_lps) and rkl is not None
    assert np.array_equal(rkl, s_lps - t_lps)


def test_without_rollout_logprobs_there_is_no_reverse_kl() -> None:
    v = small_vocab("a")
    al = align_response(v, small_vocab("b"), v.encode("fox"), "b")
    teacher, rkl = span_signal(al, np.full(al.teacher_ids.shape[0], -1.0, np.float32), None)
    assert rkl is None and teacher.shape == (al.student_spans[-1],)


# ---------------------------------------------------------------- real tokenizers

REAL_TEXTS = [
    *TEXTS,
    "```python\nimport numpy as np\nx = np.arange(10) ** 2  # squares\n```",
    "Voilà: «déjà vu» — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∀x∈ℝ, x² ≥ 0 ✓",  # noqa: RUF001
    "<|im_end|> spelled in the text is text; so is <｜end▁of▁sentence｜> and [gMASK]",  # noqa: RUF001
]


@pytest.mark.parametrize("teacher_family", ["deepseek-v3", "glm-4.7-flash"])
@pytest.mark.parametrize("text", REAL_TEXTS)
def test_qwen_student_aligns_with_real_teacher_tokenizers(teacher_family: str, text: str) -> None:
    student = family_vocab("qwen-3.5")
    teacher = family_vocab(teacher_family, "teacher_tokenizers[t]")
    im_end = student.tokenizer.token_to_id("<|im_end|>")
    assert student.textless[im_end]
    ids = np.concatenate([student.encode(text), [im_end]])
    al = align_response(student, teacher, ids, teacher_family)
    check_alignment(student, teacher, ids, al)
    assert teacher.join(al.teacher_ids) == text.encode("utf-8")
    assert al.scored[:-1].all() and not al.scored[-1]


def reference_spans(s_lens: list[int], t_lens: list[int]) -> list[tuple[int, int, int, int]]:
    """Spans by walking the bytes, for responses whose every token has bytes: a span ends
    at each byte offset that ends a token on both sides. ``(s0, s1, t0, t1)`` each."""
    spans = []
    i = j = s_end = t_end = 0
    s0 = t0 = 0
    while i < len(s_lens) or j < len(t_lens):
        if j >= len(t_lens) or (i < len(s_lens) and s_end + s_lens[i] <= t_end + t_lens[j]):
            s_end += s_lens[i]
            i += 1
        else:
            t_end += t_lens[j]
            j += 1
        if s_end == t_end and (i, j) != (s0, t0):
            spans.append((s0, i, t0, j))
            s0, t0 = i, j
    return spans


@pytest.mark.parametrize("seed", range(20))
def test_random_tokenizations_align_like_a_byte_walk(seed: int) -> None:
    # the student's ids: a text of random pieces, its tokens randomly split into their
    # single bytes (so tokens split characters anywhere)
    rng = np.random.default_rng(seed)
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    pieces = [*" ".join(TEXTS).split(" "), "🎉", "👍🏽", "平方", "\n", "  "]
    text = " ".join(rng.choice(pieces, int(rng.integers(1, 40))).tolist())
    byte_id = {v: i for i, v in enumerate(a_vocab.token_bytes) if len(v) == 1}
    ids: list[int] = []
    for tok in a_vocab.encode(text).tolist():
        if rng.random() < 0.3:
            ids.extend(byte_id[bytes([c])] for c in a_vocab.token_bytes[tok])
        else:
            ids.append(tok)
    student = np.array(ids)
    al = align_response(a_vocab, b_vocab, student, "b")
    check_alignment(a_vocab, b_vocab, student, al)
    s_lens = [len(a_vocab.token_bytes[i]) for i in ids]
    t_lens = [len(b_vocab.token_bytes[i]) for i in al.teacher_ids.tolist()]
    got = list(
        zip(
            al.student_spans[:-1].tolist(),
            al.student_spans[1:].tolist(),
            al.teacher_spans[:-1].tolist(),
            al.teacher_spans[1:].tolist(),
            strict=True,
        )
    )
    assert got == reference_spans(s_lens, t_lens)


def test_an_empty_response_has_no_span() -> None:
    al = align_response(small_vocab("a"), small_vocab("b"), np.zeros(0, np.int64), "b")
    assert al.student_spans.tolist() == [0] and al.teacher_spans.tolist() == [0]
    assert al.span_bytes.tolist() == [0] and al.scored.shape == (0,)
    teacher, rkl = span_signal(al, np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert teacher.shape == (0,) and rkl is not None and rkl.shape == (0,)


def test_a_cut_character_inside_a_token_leaves_its_whole_span_unscored() -> None:
    # b's token " \xf0\x9f" is a space and half an emoji: the teacher sees the space only
    student, teacher = small_vocab("b"), small_vocab("a")
    half = student.token_bytes.index(b" \xf0\x9f")
    ids = np.concatenate([student.encode("ok"), [half]])
    al = align_response(student, teacher, ids, "a")
    assert teacher.join(al.teacher_ids) == b"ok "
    assert al.span_bytes.tolist()[-2:] == [2, 5]
    assert al.teacher_spans[-1] - al.teacher_spans[-2] >= 1  # the teacher's " " is in it
    assert not al.scored[-1] and al.scored[:-1].all()
    _, rkl = span_signal(
        al, np.full(al.teacher_ids.shape[0], -1.0, np.float32), np.full(ids.shape, -1.0, np.float32)
    )
    assert rkl is not None and rkl[-1] == 0.0


def test_top_k_candidates_are_kept_at_one_to_one_spans_by_their_bytes() -> None:
    from opd_stream.xtok._align import byte_twins, candidate_rows, one_to_one, teacher_candidates

    student, teacher = small_vocab("b"), small_vocab("a")
    ids = student.encode("x🎉y")  # spans: x | 3 tokens of the emoji vs 1 | y
    al = align_response(student, teacher, ids, "a")
    s_rows, t_rows = one_to_one(al)
    assert s_rows.tolist() == [0, 4] and t_rows.tolist() == [0, 2]
    twins = byte_twins(student, teacher)
    end = student.tokenizer.token_to_id(SPECIAL)
    y_t = teacher.tokenizer.token_to_id("y")
    x_s, y_s = student.tokenizer.token_to_id("x"), student.tokenizer.token_to_id("y")
    assert twins[x_s] == teacher.tokenizer.token_to_id("x") and twins[end] == -1
    no_twin = next(v for v in range(student.size) if twins[v] < 0 and not student.textless[v])
    top = np.array(
        [
            [x_s, end, no_twin, -1],  # row 0: x, a textless and an untwinned candidate
            [x_s, y_s, -1, -1],  # rows 1-3: inside the emoji's span: nothing kept
            [x_s, y_s, -1, -1],
            [x_s, y_s, -1, -1],
            [y_s, x_s, -1, -1],  # row 4: y
        ]
    )
    kept, asked = teacher_candidates(al, top, twins)
    assert kept.tolist() == [
        [x_s, -1, -1, -1],
        [-1] * 4,
        [-1] * 4,
        [-1] * 4,
        [y_s, x_s, -1, -1],
    ]
    assert asked.tolist() == [
        [twins[x_s], -1, -1, -1],
        [-1] * 4,
        [y_t, twins[x_s], -1, -1],
    ]
    lps = np.arange(12, dtype=np.float32).reshape(3, 4) * -1
    rows = candidate_rows(al, lps, kept.shape)
    assert rows[0].tolist() == lps[0].tolist() and rows[4].tolist() == lps[2].tolist()
    assert np.isnan(rows[1:4]).all()


def test_two_candidates_of_the_same_bytes_keep_the_better_ranked() -> None:
    from opd_stream.xtok._align import teacher_candidates

    student, teacher = small_vocab("b"), small_vocab("a")
    ids = student.encode("x")
    al = align_response(student, teacher, ids, "a")
    twins = np.full(student.size, -1, dtype=np.int64)
    twins[[5, 6, 7]] = [40, 41, 40]  # ids 5 and 7 spell the same bytes
    kept, asked = teacher_candidates(al, np.array([[7, 6, 5]]), twins)
    assert kept.tolist() == [[7, 6, -1]] and asked.tolist() == [[40, 41, -1]]


def searchsorted_alignment(
    student: Vocab, teacher: Vocab, ids: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The alignment's spans as the first implementation found them (every boundary by
    binary search over both sides' byte ends): the reference of the cumulative-count one."""
    lengths = student.lengths[ids]
    ends = np.cumsum(lengths)
    data = b"".join(student.token_bytes[i] for i in ids.tolist())
    total = cut = len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        cut = exc.start
        text = data[:cut].decode("utf-8")
    t_ids = teacher.encode_reference(text)
    t_ends = np.cumsum(teacher.lengths[t_ids])
    s_ends = ends[lengths > 0]
    at = np.minimum(np.searchsorted(t_ends, s_ends), max(t_ends.shape[0] - 1, 0))
    common = s_ends[t_ends[at] == s_ends] if t_ends.shape[0] else s_ends[:0]
    if cut < total:
        common = np.append(common, total)
    k = np.searchsorted(common, ends, side="left")
    keys = 2 * k + 1
    zero = lengths == 0
    if zero.any():
        at, pos = k[zero], ends[zero]
        on_boundary = np.append(common, -1)[at] == pos
        keys[zero] = np.where(pos == 0, 0, np.where(on_boundary, 2 * (at + 1), 2 * at + 1))
    t_keys = 2 * np.searchsorted(common, t_ends, side="left") + 1
    r = ids.shape[0]
    starts = np.flatnonzero(np.diff(keys)) + 1
    span_keys = keys[np.concatenate([[0], starts])] if r else keys[:0]
    student_spans = np.concatenate([[0], starts, [r]] if r else [[0]])
    t_starts = np.searchsorted(t_keys, span_keys, side="left")
    teacher_spans = np.concatenate([t_starts, [t_ids.shape[0]]])
    scored = (span_keys % 2 == 1) & (teacher_spans[1:] > teacher_spans[:-1])
    if cut < total:
        scored &= span_keys != 2 * (common.shape[0] - 1) + 1
    return t_ids, student_spans, teacher_spans, scored


@pytest.mark.parametrize("seed", range(40))
def test_spans_with_textless_tokens_and_cut_characters_match_the_binary_search_reference(
    seed: int,
) -> None:
    # random text, tokens randomly split into bytes, textless tokens anywhere (runs too),
    # sometimes cut inside the last character
    rng = np.random.default_rng(1000 + seed)
    a_vocab, b_vocab = small_vocab("a"), small_vocab("b")
    pieces = [*" ".join(TEXTS).split(" "), "🎉", "👍🏽", "平方", "\n", "  ", "é"]
    text = " ".join(rng.choice(pieces, int(rng.integers(1, 40))).tolist())
    byte_id = {v: i for i, v in enumerate(a_vocab.token_bytes) if len(v) == 1}
    textless = np.flatnonzero(a_vocab.textless).tolist()
    ids: list[int] = []
    for tok in a_vocab.encode(text).tolist():
        while rng.random() < 0.15:
            ids.append(int(rng.choice(textless)))
        if rng.random() < 0.3:
            ids.extend(byte_id[bytes([c])] for c in a_vocab.token_bytes[tok])
        else:
            ids.append(tok)
    while rng.random() < 0.3:
        ids.append(int(rng.choice(textless)))
    student = np.array(ids, dtype=np.int64)
    if rng.random() < 0.3:  # cut inside the last multi-byte character, if any
        data = b"".join(a_vocab.token_bytes[i] for i in ids)
        for n in range(len(ids) - 1, 0, -1):
            try:
                a_vocab.join(student[:n]).decode("utf-8")
            except UnicodeDecodeError:
                student = student[:n]
                break
        assert data.startswith(a_vocab.join(student))
    al = align_response(a_vocab, b_vocab, student, "b")
    check_alignment(a_vocab, b_vocab, student, al)
    t_ids, s_spans, t_spans, scored = searchsorted_alignment(a_vocab, b_vocab, student)
    assert al.teacher_ids.tolist() == t_ids.tolist()
    assert al.student_spans.tolist() == s_spans.tolist()
    assert al.teacher_spans.tolist() == t_spans.tolist()
    assert al.scored.tolist() == scored.tolist()


def test_join_is_the_concatenation_of_the_tokens_bytes() -> None:
    vocab = small_vocab("a")
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 300):
        ids = rng.integers(0, vocab.size, n)
        expected = b"".join(vocab.token_bytes[i] for i in ids.tolist())
        assert vocab.join(ids) == expected
        assert vocab.join(ids, np.cumsum(vocab.lengths[ids])) == expected
    textless = np.flatnonzero(vocab.textless)
    assert vocab.join(textless) == b""
