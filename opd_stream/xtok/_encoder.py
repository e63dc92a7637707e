"""A faster exact encoder for a teacher's byte-level BPE: ``tiktoken`` built from its
``tokenizer.json``, used only where it gives the ids of ``tokenizers`` exactly.

``tiktoken`` (optional) is built from the file, never downloaded, and only for the shapes
whose ids are provably the same (the merges, the pre-tokenisation, the normaliser, the added
tokens); before it is used, both encoders must give the same ids for every text of
:data:`CHECK_TEXTS`. Any difference: no fast encoder, and
:class:`~opd_stream.xtok._vocab.Vocab` encodes with ``tokenizers``. The shapes, and why:
``docs/design-notes.md``, "opd_stream/xtok/_encoder.py".
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ("CHECK_TEXTS", "FastEncoder", "fast_encoder")

IntArray = npt.NDArray[np.int64]

# tokenizers' ByteLevel pre-tokeniser regex (use_regex=True): GPT-2's
_GPT2: Final = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# DeepSeek V3's three Split regexes, applied in turn to the pieces of the one before
_DS_NUM: Final = r"\p{N}{1,3}"
_DS_CJK_RANGES: Final = "\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff"
_DS_CJK: Final = f"[{_DS_CJK_RANGES}]+"
_DS_WORDS: Final = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^"""
    "\r\n"
    r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+["""
    "\r\n"
    r"""]*|\s*["""
    "\r\n"
    r"""]+|\s+(?!\S)|\s+"""
)

CHECK_TEXTS: Final[tuple[str, ...]] = (
    "The quick brown fox jumps over the lazy dog. It's 12:45 -- isn't it? I'LL see.",
    "def square(x):\n    return x ** 2  # 平方\n\n\tprint(square(1234567))\r\n",
    '{"key": [1, 2, 3], "name": "Größe café naïve"} .NET !important @user #tag',
    "你好世界 東京 北京、日本語のテキスト・データ。ゞ゛ カタカナー ｶﾀｶﾅ 한국어 텍스트",
    "Привет мир Ελληνικά العربية ٣٤٥ हिन्दी ไทย עברית e\u0301 \u3099か",
    "🎉🎉 👍🏽 ❤️ 🇫🇷 👨\u200d👩\u200d👧 \u200b\ufeff ²³ Ⅻ \u3007 ① \U0001d518\U0001d52b\U0001d526",
    "a  1 b\u00a0\u00a02  c\u3000\u30003\n \n\n  x\x00y\x01\x7f\x85z \x0b\x0c\x1c",
    "ab你好 x123y 1a2b3c !a ... ?? \u3040\u3097 \ue000\ue001 \U000f0000",
    "   leading and trailing   \n",
)


class FastEncoder:
    """``tiktoken`` set up as one ``tokenizer.json``'s exact equivalent.

    Attributes:
        encoding: the ``tiktoken.Encoding`` (its ids are ranks).
        rank_to_id: int64, the tokenizer's id of each rank.
        allowed: the added tokens it cuts out of text (``allowed_special``).
    """

    def __init__(
        self,
        encoding: Any,
        rank_to_id: IntArray,
        allowed: frozenset[str],
        nfc: bool,
    ) -> None:
        self.encoding = encoding
        self.rank_to_id = rank_to_id
        self.allowed = allowed
        self._nfc = nfc

    def encode(self, text: str) -> IntArray | None:
        """The ids of ``text``, or None when this encoder cannot say (text that an NFC
        normaliser would change)."""
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            return None
        ranks = self.encoding.encode_to_numpy(
            text, allowed_special=self.allowed, disallowed_special=()
        )
        ids: IntArray = self.rank_to_id[ranks]
        return ids


def _deepseek_cascade() -> str:
    """DeepSeek's three ``Split`` (numbers; CJK runs; words) as one regex of the same
    pieces: numbers and CJK runs come first at any position, the word alternatives never
    take a digit or a CJK character past their first, ``\\s+(?!\\S)`` sees a number or a
    CJK character as the end of its piece, the word regex's pieces inside a CJK run are
    spelled out over CJK characters only, and unmatched runs stay within their piece."""
    c = _DS_CJK_RANGES
    cjk = [  # the word regex over a CJK run: letters/marks, punctuation/symbols
        rf"[{c}&&[^\p{{L}}\p{{P}}\p{{S}}]]?[{c}&&[\p{{L}}\p{{M}}]]+",
        rf"[{c}&&[\p{{P}}\p{{S}}]]+",
    ]
    words = [
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+""",
        rf"[^\r\n\p{{L}}\p{{P}}\p{{S}}\p{{N}}{c}]?[\p{{L}}\p{{M}}&&[^{c}]]+",
        rf" ?[\p{{P}}\p{{S}}&&[^{c}]]+[\r\n]*",
        r"\s*[\r\n]+",
        rf"\s+(?![^\s\p{{N}}{c}])",
        r"\s+",
    ]
    alts = [_DS_NUM, *cjk, *words]
    anything = "(?:" + "|".join(alts) + ")"
    gaps = [rf"(?:(?!{anything})[{c}])+", rf"(?:(?!{anything})[^{c}])+"]
    return "|".join([*alts, *gaps])


def _with_gaps(pattern: str) -> str:
    """``pattern`` plus one last alternative: a run of characters where it matches
    nothing (a piece of its own in ``tokenizers``; ``tiktoken`` would drop it)."""
    return f"{pattern}|(?:(?!(?:{pattern}))(?s:.))+"


def _split_regex(step: Any) -> str | None:
    """A ``Split`` step's pieces as one regex: ``Isolated`` keeps the matches and the runs
    between them (a last alternative takes those); ``Removed`` with ``invert`` keeps the
    matches only (MiniMax), as ``tiktoken`` does."""
    if not isinstance(step, Mapping) or step.get("type") != "Split":
        return None
    pattern = step.get("pattern")
    if not isinstance(pattern, Mapping) or not isinstance(pattern.get("Regex"), str):
        return None
    regex = str(pattern["Regex"])
    if step.get("behavior") == "Isolated" and not step.get("invert"):
        return _with_gaps(regex)
    if step.get("behavior") == "Removed" and step.get("invert"):
        return regex
    return None


def _plain_byte_level(step: Any, *, regex: bool) -> bool:
    return (
        isinstance(step, Mapping)
        and step.get("type") == "ByteLevel"
        and not step.get("add_prefix_space")
        and bool(step.get("use_regex", True)) == regex
    )


def pre_tokenizer_regex(pre: Any) -> str | None:
    """The one regex whose matches are ``pre``'s pieces, or None (a shape not known to
    convert exactly)."""
    if _plain_byte_level(pre, regex=True):
        return _with_gaps(_GPT2)
    if not isinstance(pre, Mapping) or pre.get("type") != "Sequence":
        return None
    steps = list(pre.get("pretokenizers") or ())
    if not steps or not _plain_byte_level(steps[-1], regex=False):
        return None
    if len(steps) == 2:
        return _split_regex(steps[0])
    cascade = [_split_regex(s) for s in steps[:-1]]
    if cascade == [_with_gaps(_DS_NUM), _with_gaps(_DS_CJK), _with_gaps(_DS_WORDS)]:
        return _deepseek_cascade()
    return None


def _normalizer_nfc(normalizer: Any) -> bool | None:
    """False: no normaliser; True: NFC; None: another one."""
    if normalizer is None:
        return False
    if isinstance(normalizer, Mapping):
        if normalizer.get("type") == "NFC":
            return True
        if normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"):
            return False
    return None


def _ranks(
    model: Mapping[str, Any],
    to_bytes: Callable[[str], bytes | None],
    bpe: Callable[[str], list[int]],
) -> tuple[dict[bytes, int], list[int]] | None:
    """``(bytes -> rank, rank -> id)`` of a BPE model, or None when its merges do not
    convert exactly (see the module's doc).

    ``bpe``: the ids the model's merges give a vocabulary entry (its byte symbols as one
    piece), to check ``tiktoken``'s shortcut (a piece that is a vocabulary entry is that
    entry) where ``ignore_merges`` is off.
    """
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    vocab = model.get("vocab")
    merges = model.get("merges")
    if not isinstance(vocab, Mapping) or not isinstance(merges, Sequence):
        return None
    by_bytes: dict[bytes, tuple[str, int]] = {}
    for token, i in vocab.items():
        b = to_bytes(token)
        if b is not None:  # an added token's entry, not made of byte symbols: not BPE's
            if b in by_bytes:
                return None
            by_bytes[b] = (token, int(i))
    ranks: dict[bytes, int] = {}
    rank_to_id: list[int] = []
    for byte in range(256):
        single = bytes((byte,))
        if single not in by_bytes:
            return None
        ranks[single] = byte
        rank_to_id.append(by_bytes[single][1])
    pairs: list[tuple[bytes, bytes]] = []
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if len(pair) != 2:
            return None
        left, right = to_bytes(pair[0]), to_bytes(pair[1])
        if left is None or right is None:
            return None
        pairs.append((left, right))
    # a merge's parts are bytes or made by a merge (maybe a later one: it applies once both
    # parts are there, in tokenizers as in tiktoken)
    makes = {left + right for left, right in pairs}
    latest = b""
    for left, right in pairs:
        if (len(left) > 1 and left not in makes) or (len(right) > 1 and right not in makes):
            return None
        made = left + right
        if made in ranks:
            # another merge of the newest entry (files converted from tiktoken list every
            # split of an entry together) ranks as it; any other repeat: no conversion
            if made != latest:
                return None
            continue
        if made not in by_bytes:
            return None
        latest = made
        ranks[made] = len(rank_to_id)
        rank_to_id.append(by_bytes[made][1])
    if len(ranks) != len(by_bytes) and model.get("ignore_merges"):
        return None  # an entry no merge makes, that a whole piece would be: not tiktoken's
    if not model.get("ignore_merges"):
        # tiktoken takes a piece that is an entry as that entry; the merges must agree
        for made in ranks:
            token, i = by_bytes[made]
            if len(made) > 1 and bpe(token) != [i]:
                return None
    return ranks, rank_to_id


def _added(data: Mapping[str, Any]) -> dict[str, int] | None:
    """The non-special added tokens (text -> id), or None when one is inside another
    added token's text."""
    entries = [a for a in data.get("added_tokens") or () if isinstance(a, Mapping)]
    plain = {str(a["content"]): int(a["id"]) for a in entries if not a.get("special")}
    contents = [str(a["content"]) for a in entries]
    for text in plain:
        if not text or any(text != other and text in other for other in contents):
            return None
    for a in entries:
        if not a.get("special") and (a.get("lstrip") or a.get("rstrip") or a.get("single_word")):
            return None
    return plain


def fast_encoder(
    data: Mapping[str, Any],
    to_bytes: Callable[[str], bytes | None],
    reference: Callable[[str], list[int]],
    bpe: Callable[[str], list[int]],
) -> FastEncoder | None:
    """A :class:`FastEncoder` for the ``tokenizer.json`` ``data``, or None: ``tiktoken``
    is not installed, the file's shape is not one known to convert exactly, or the two
    encoders differ on :data:`CHECK_TEXTS`.

    Args:
        data: the parsed ``tokenizer.json``.
        to_bytes: a vocabulary entry's bytes (None: not made of byte-level symbols).
        reference: ``tokenizers``' ids of a text, as :class:`~opd_stream.xtok._vocab.Vocab`
            encodes it.
        bpe: ``tokenizers``' BPE model alone: the ids of a vocabulary entry's symbols.
    """
    try:
        import tiktoken
    except ImportError:
        return None
    nfc = _normalizer_nfc(data.get("normalizer"))
    pattern = pre_tokenizer_regex(data.get("pre_tokenizer"))
    model = data.get("model")
    added = _added(data)
    if nfc is None or pattern is None or not isinstance(model, Mapping) or added is None:
        return None
    converted = _ranks(model, to_bytes, bpe)
    if converted is None:
        return None
    ranks, rank_to_id = converted
    special = {text: len(rank_to_id) + j for j, text in enumerate(added)}
    table = np.asarray([*rank_to_id, *added.values()], dtype=np.int64)
    try:
        encoding = tiktoken.Encoding(
            "opd_stream", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
    except Exception:  # a regex its engine does not take
        return None
    if not hasattr(encoding, "encode_to_numpy"):  # tiktoken < 0.7
        return None
    encoder = FastEncoder(encoding, table, frozenset(special), nfc)
    texts = [*CHECK_TEXTS, "".join(added), *(f"x {t}y\n{t}" for t in added)]
    for text in texts:
        got = encoder.encode(text)
        if got is not None and got.tolist() != reference(text):
            return None
    return encoder
