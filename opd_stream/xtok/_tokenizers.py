"""A stream's tokenizers for teachers with another tokenizer, and what the pipeline asks of
them, in plain values (numpy arrays, names; no sample or settings type).

:class:`CrossTokenizers` holds the student's and each listed teacher's tokenizer, loaded once
as the stream starts (:meth:`CrossTokenizers.load`); :meth:`CrossTokenizers.prepare` gives,
per sample, the response's alignment and the teacher's request input (:class:`TeacherInput`),
in a decode thread from :data:`THREAD_TOKENS` response tokens on, and always where the
teacher's encoder is a process of its own. In top-k mode :func:`topk_candidates` picks what
the teacher is asked and :func:`topk_rows` turns its answer into student-row arrays. The
KL result is :mod:`opd_stream._scoring`'s; the answer's ids are checked against the ids sent,
as any teacher's (a mismatch: ``misaligned_response``). In full: ``docs/design-notes.md``,
"opd_stream/xtok/_tokenizers.py".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from .._errors import InvalidSampleError
from ..wire._answers import ScoreRows
from ._align import (
    Alignment,
    align_response,
    byte_twins,
    candidate_rows,
    span_signal,
    teacher_candidates,
)
from ._vocab import Vocab, load_vocab_process

__all__ = (
    "THREAD_TOKENS",
    "CrossTokenizers",
    "TeacherInput",
    "empty_rows",
    "topk_candidates",
    "topk_rows",
)

THREAD_TOKENS: Final = 256
"""Responses at least this long are aligned in a decode thread, not on the event loop."""


class TeacherInput(msgspec.Struct, frozen=True, kw_only=True):
    """One sample's teacher side: what the teacher is asked, and the alignment."""

    tokens: npt.NDArray[np.int64]
    """What the teacher request sends: the teacher prompt + the teacher's ids of the
    response (``alignment.teacher_ids``, the last ``response_length`` of them)."""
    prompt_length: int
    alignment: Alignment

    @property
    def response_length(self) -> int:
        """The teacher's ids of the response: how many."""
        return int(self.alignment.teacher_ids.shape[0])


def empty_rows() -> ScoreRows:
    """The teacher's answer when the response has no text (only textless tokens): nothing
    to ask."""
    return ScoreRows(
        token_ids=np.zeros(0, np.int64),
        token_logprobs=np.zeros(0, np.float32),
        top_ids=None,
        top_logprobs=None,
        id_logprobs=None,
        used_b64=False,
        weight_version=None,
    )


class CrossTokenizers:
    """The tokenizers of one stream whose configuration lists ``teacher_tokenizers``."""

    def __init__(
        self,
        student: Vocab,
        teachers: dict[str, Vocab],
        *,
        return_alignment: bool = False,
        top_k: bool = False,
    ) -> None:
        self.student = student
        self.teachers = teachers
        self.return_alignment = return_alignment
        # top-k: each teacher's token of the same bytes as each student id
        self.twins = (
            {name: byte_twins(student, vocab) for name, vocab in teachers.items()} if top_k else {}
        )

    @classmethod
    def load(
        cls,
        student_tokenizer: str | None,
        teacher_tokenizers: Mapping[str, str] | None,
        *,
        return_alignment: bool = False,
        top_k: bool = False,
    ) -> CrossTokenizers | None:
        """Load the tokenizers (the settings ``student_tokenizer`` and ``teacher_tokenizers``:
        teacher name -> path), or None when no teacher has its own (blocking: ~1-4 s each;
        one load per file). Each is loaded and run in a process of its own
        (:mod:`opd_stream.xtok._worker`: building a tokenizer holds the GIL for up to
        0.6 s at a stretch, which no thread of the host's process may do); stop them with
        :meth:`close`.

        Raises:
            ConfigError: a missing, unreadable or unsupported file, naming the setting and
                the path.
        """
        if not teacher_tokenizers or student_tokenizer is None:
            return None
        settings = {student_tokenizer: "student_tokenizer"}  # path -> its first setting
        for name, path in teacher_tokenizers.items():
            settings.setdefault(path, f"teacher_tokenizers[{name}]")
        loaded = _load_all(settings)
        try:
            student = loaded[student_tokenizer]
            teachers = {name: loaded[path] for name, path in teacher_tokenizers.items()}
            return cls(student, teachers, return_alignment=return_alignment, top_k=top_k)
        except BaseException:
            for vocab in loaded.values():
                vocab.close()
            raise

    @property
    def encodes_apart(self) -> bool:
        """Whether a teacher's encoder runs in a process of its own
        (:mod:`opd_stream.xtok._worker`): :meth:`prepare` then waits on a pipe, so it never
        runs on the event loop, however short the response."""
        return any(vocab.process is not None for vocab in self.teachers.values())

    def close(self) -> None:
        """Stop the tokenizers' processes (blocking, briefly)."""
        for vocab in {id(v): v for v in (self.student, *self.teachers.values())}.values():
            vocab.close()

    def teacher(self, name: str) -> Vocab | None:
        """The teacher's own tokenizer, or None (it shares the student's vocabulary)."""
        return self.teachers.get(name)

    def aligns(self, name: str) -> bool:
        """Results of teacher ``name`` carry an alignment (it has its own tokenizer, and
        ``return_alignment`` is set)."""
        return self.return_alignment and name in self.teachers

    def check_prompt(self, teacher: str, teacher_tokens: npt.NDArray[np.int64] | None) -> None:
        """A sample routed to a teacher with its own tokenizer carries the teacher prompt
        (``teacher_tokens``: its ``teacher_prompt_ids`` + the response, or None).

        Raises:
            InvalidSampleError: ``teacher_prompt_ids`` is missing.
        """
        if teacher_tokens is None and teacher in self.teachers:
            raise InvalidSampleError(
                "teacher_prompt_ids",
                f"required: teacher {teacher!r} has its own tokenizer, so its prompt "
                "must be given in its ids (render it with its chat template, e.g. "
                "opd_stream.integrations' teacher prompt rendering)",
            )

    def prepare(
        self,
        teacher: str,
        tokens: npt.NDArray[np.int64],
        response_length: int,
        teacher_tokens: npt.NDArray[np.int64] | None,
    ) -> TeacherInput:
        """Align the response (the last ``response_length`` of the student's ``tokens``) for
        ``teacher`` and build its request input from ``teacher_tokens`` (the teacher prompt
        + the response; blocking: CPU).

        Raises:
            InvalidSampleError: see :func:`~opd_stream.xtok._align.align_response`, and a
                missing ``teacher_prompt_ids``.
        """
        vocab = self.teachers[teacher]
        self.check_prompt(teacher, teacher_tokens)
        assert teacher_tokens is not None  # checked above
        r = response_length
        response = tokens[tokens.shape[0] - r :]
        alignment = align_response(self.student, vocab, response, teacher)
        prompt = teacher_tokens[: teacher_tokens.shape[0] - r]
        return TeacherInput(
            tokens=np.concatenate([prompt, alignment.teacher_ids]),
            prompt_length=prompt.shape[0],
            alignment=alignment,
        )


def _load_all(settings: Mapping[str, str]) -> dict[str, Vocab]:
    """Each path's :class:`Vocab` (``settings``: path -> the setting that names it), its
    process started and loaded beside the others' (each load blocks 1-4 s), in threads
    that end before this returns. If any fails, the others are stopped and the first
    failure, in ``settings``' order, is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(
        max_workers=len(settings), thread_name_prefix="opd_stream.xtok"
    ) as pool:
        futures = {path: pool.submit(load_vocab_process, s, path) for path, s in settings.items()}
    loaded: dict[str, Vocab] = {}
    failures: list[BaseException] = []
    for path, future in futures.items():
        error = future.exception()
        if error is None:
            loaded[path] = future.result()
        else:
            failures.append(error)
    if failures:
        for vocab in loaded.values():
            vocab.close()
        raise failures[0]
    return loaded


def topk_candidates(
    xtok: CrossTokenizers, teacher: str, alignment: Alignment, student_ids: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
    """Only-student top-k: ``(kept student ids [R, k], teacher ids to ask [R_t, k] or None
    when nothing is asked)`` (see :func:`~opd_stream.xtok._align.teacher_candidates`)."""
    kept, asked = teacher_candidates(alignment, student_ids, xtok.twins[teacher])
    return kept, (asked if bool((asked >= 0).any()) else None)


def topk_rows(alignment: Alignment, rows: ScoreRows, kept: npt.NDArray[np.int64]) -> ScoreRows:
    """The teacher's answer (its ``R_t`` rows) as the KL stage reads a top-k answer, on the
    student's ``R`` rows: ``token_logprobs`` the span values (the teacher's logprob of each
    span's text on its last student token, 0 elsewhere) and ``id_logprobs`` the teacher's
    logprobs of the kept candidates (NaN where nothing was asked)."""
    teacher, _ = span_signal(alignment, rows.token_logprobs, None)
    r = kept.shape[0]
    return ScoreRows(
        token_ids=np.zeros(r, np.int64),
        token_logprobs=teacher,
        top_ids=None,
        top_logprobs=None,
        id_logprobs=candidate_rows(alignment, rows.id_logprobs, kept.shape),
        used_b64=rows.used_b64,
        weight_version=rows.weight_version,
    )
