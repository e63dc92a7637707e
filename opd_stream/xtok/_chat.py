"""A teacher's chat template: chat messages -> the teacher's prompt ids.

For samples that carry the prompt as chat messages (Miles, ``opd-stream score``'s
``prompt_messages``), not as teacher ids: the messages are rendered with the teacher's own
chat template (``tokenizer_config.json``'s ``chat_template`` next to its ``tokenizer.json``,
``default`` of a named list, or ``chat_template.jinja``) and encoded with the teacher's
tokenizer, special-token strings recognised; nothing is added around the template's text.
The template runs in jinja2's immutable sandbox (the ``[xtok]`` extra). What the template
sees: ``docs/design-notes.md``, "opd_stream/xtok/_chat.py".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, InvalidSampleError
from ._vocab import resolve_tokenizer_path

if TYPE_CHECKING:
    from ._process import EncoderProcess

__all__ = ("ChatTemplate", "TeacherPrompts", "as_messages", "read_template")

_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token")


def _token_text(value: Any) -> str:
    if isinstance(value, Mapping):  # an AddedToken written as a dict
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def as_messages(value: Any, field: str) -> list[dict[str, Any]]:
    """Chat messages from a sample: a list of ``{"role": str, "content": ...}`` mappings,
    or a plain string (one user message).

    Raises:
        InvalidSampleError: any other shape, naming ``field``.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise InvalidSampleError(
            field, "expected a non-empty list of {role, content} messages or a string"
        )
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidSampleError(field, f"message {i} is not a mapping with a string 'role'")
        out.append(dict(message))
    return out


def read_template(setting: str, path: str) -> tuple[str, dict[str, str]]:
    """The chat template beside the tokenizer that ``path`` names, and its special tokens
    (``bos_token``, ...), from the small files only (``tokenizer_config.json``,
    ``chat_template.jinja``; never the tokenizer itself): cheap enough to check a
    configuration with.

    Raises:
        ConfigError: no template there, or an unreadable file; naming ``setting`` and the
            folder.
    """
    folder = os.path.dirname(resolve_tokenizer_path(setting, path))
    config: Any = {}
    config_file = os.path.join(folder, "tokenizer_config.json")
    jinja_file = os.path.join(folder, "chat_template.jinja")
    try:
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("tokenizer_config.json is not a JSON object")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{setting}: cannot read the chat template in {folder}: {exc}") from None
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"{setting}: no chat template in {folder} (tokenizer_config.json "
            "'chat_template' or chat_template.jinja): the teacher's prompts are rendered "
            "with its own chat template"
        )
    return template, {key: _token_text(config.get(key)) for key in _TOKEN_KEYS}


class ChatTemplate:
    """One teacher's chat template and tokenizer (special tokens recognised in prompts);
    the tokenizer is loaded and run in a process of its own
    (:class:`~opd_stream.xtok._process.EncoderProcess`: building it in this one would hold
    the GIL, so the host's event loop, for up to 0.6 s).

    Build it with :meth:`load`; :meth:`prompt_ids` is blocking (~1 ms: the rendering, and a
    round trip to that process).
    """

    def __init__(
        self, setting: str, template: str, tokens: dict[str, str], encoder: EncoderProcess
    ):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        def tojson(value: Any, indent: int | None = None, **_: Any) -> str:
            return json.dumps(value, ensure_ascii=False, indent=indent)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"{setting}: the chat template does not parse: {exc}") from None
        self._error = jinja2.TemplateError
        self.setting = setting
        self.tokens = tokens
        self.encoder = encoder

    @classmethod
    def load(cls, setting: str, path: str) -> ChatTemplate:
        """The chat template beside the tokenizer that ``path`` names, its tokenizer's
        process started (blocking, 1-4 s).

        Raises:
            ConfigError: no template there, or jinja2/tokenizers missing, or an unreadable
                file; naming ``setting`` and the path.
        """
        file = resolve_tokenizer_path(setting, path)
        folder = os.path.dirname(file)
        template, tokens = read_template(setting, path)
        try:
            import jinja2  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"{setting}: rendering a teacher prompt needs jinja2 and tokenizers "
                "(pip install 'opd-stream[xtok]')"
            ) from None
        from ._process import EncoderProcess

        try:  # in a process of its own: building it would hold the host's GIL ~0.3-0.6 s
            process = EncoderProcess(setting, file)
        except ConfigError as exc:
            raise ConfigError(f"{setting}: cannot read the tokenizer in {folder} ({exc})") from None
        return cls(setting, template, tokens, process)

    def render(
        self,
        messages: list[dict[str, Any]],
        field: str = "prompt_messages",
        *,
        tools: Any = None,
    ) -> str:
        """The prompt text, ending where the assistant's answer starts.

        Args:
            messages: the chat messages.
            field: the sample field named in errors.
            tools: the tool definitions the template is given as ``tools`` (None: the
                variable is left undefined, as a template expects without tools).

        Raises:
            InvalidSampleError: the template refuses the messages (its own message).
        """
        extra = {} if tools is None else {"tools": tools}
        try:
            return str(
                self._template.render(
                    messages=messages, add_generation_prompt=True, **self.tokens, **extra
                )
            )
        except self._error as exc:
            raise InvalidSampleError(field, f"the teacher's chat template failed: {exc}") from None

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        field: str = "prompt_messages",
        *,
        tools: Any = None,
    ) -> npt.NDArray[np.int64]:
        """The teacher prompt's ids (special tokens of the text recognised, none added).

        Raises:
            InvalidSampleError: the template refuses the messages, or renders nothing.
        """
        text = self.render(messages, field, tools=tools)
        ids = self.encoder.encode(text, specials=True)
        if not ids.shape[0]:
            raise InvalidSampleError(field, "the teacher's chat template rendered no tokens")
        return ids

    def close(self) -> None:
        """Stop the tokenizer's process (blocking, briefly)."""
        self.encoder.close()


class TeacherPrompts:
    """Teacher prompts from chat messages, for each teacher with its own tokenizer: each
    template loaded on first use (thread-safe; blocking), then kept for the run; a template
    that does not load is not tried again (its error is kept).

    Args:
        tokenizers: teacher name -> tokenizer path (``StreamConfig.teacher_tokenizers``).
    """

    def __init__(self, tokenizers: Mapping[str, str] | None) -> None:
        import threading

        self._paths = dict(tokenizers or {})
        self._templates: dict[str, ChatTemplate] = {}
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._paths)

    def check(self) -> None:
        """Check that every teacher's folder holds a chat template (the small files only:
        ``tokenizer_config.json``, ``chat_template.jinja``; a few KB, not the tokenizer).

        Raises:
            ConfigError: a teacher without one, naming the setting and the folder.
        """
        for teacher, path in self._paths.items():
            read_template(f"teacher_tokenizers[{teacher}]", path)

    def template(self, teacher: str, field: str) -> ChatTemplate:
        """``teacher``'s chat template (loaded on first use: blocking, ~1 s).

        Raises:
            InvalidSampleError: (naming ``field``) a teacher without a tokenizer of its own,
                or a template that does not load (the same error again, without reading
                the files again).
        """
        path = self._paths.get(teacher)
        if path is None:
            raise InvalidSampleError(
                field,
                f"teacher {teacher!r} has no tokenizer of its own (teacher_tokenizers) to render "
                "the prompt with; give teacher_prompt_ids, or the student's tokens only",
            )
        with self._lock:
            template = self._templates.get(teacher)
            if template is None:
                error = self._errors.get(teacher)
                if error is None:
                    try:
                        template = ChatTemplate.load(f"teacher_tokenizers[{teacher}]", path)
                    except ConfigError as exc:
                        error = self._errors[teacher] = str(exc)
                    else:
                        self._templates[teacher] = template
                if error is not None:
                    raise InvalidSampleError(field, error)
        assert template is not None
        return template

    def ids(
        self, teacher: str, messages: Any, field: str, *, tools: Any = None
    ) -> npt.NDArray[np.int64]:
        """``messages`` rendered with ``teacher``'s chat template, as its ids.

        Raises:
            InvalidSampleError: (naming ``field``) bad messages, a teacher without a
                tokenizer of its own, no usable template, or the template refusing them.
        """
        chat = as_messages(messages, field)
        return self.template(teacher, field).prompt_ids(chat, field, tools=tools)
