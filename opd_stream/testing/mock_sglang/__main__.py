"""CLI: ``python -m opd_stream.testing.mock_sglang --port 0 --role teacher --seed 1 ...``.

Every :class:`MockOptions` field is a flag (``--fault-http-503 0.1``, ``--per-position
unpatched``, ``--api-key KEY``, ``--masked-ids 5,7``, ``--no-info-endpoints``). The first line
printed is ``listening on http://HOST:PORT``; SIGTERM/SIGINT stop the server.
``--vocab-size V``: the ids accepted, ``[0, V)`` (others answered 400, as SGLang does); its
default :data:`CLI_VOCAB_SIZE` (248,320) holds every tokenizer the README names, while
:class:`MockOptions`' own default stays 151,936. ``--byte-model-tokenizer PATH`` (the
``[xtok]`` extra): the sampled tokens' logprobs come from a :class:`ByteModel` over that
tokenizer's ids (``--byte-model-q``, ``--byte-model-salt``), for a teacher with another
tokenizer; ``--vocab-size`` must hold its ids.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import typing
from collections.abc import Sequence
from typing import Any

import msgspec

from ._app import MockServer
from ._bytemodel import ByteModel
from ._options import CLI_VOCAB_SIZE, MockOptions
from ._server import ServerBase

__all__ = ("build_parser", "main")

_NONE_DEFAULT_TYPES: dict[str, Any] = {"api_key": str, "fault_seed": int}


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def _str_tuple(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def build_parser(
    options_cls: type[MockOptions] = MockOptions,
    prog: str = "python -m opd_stream.testing.mock_sglang",
    description: str = "Mock SGLang server.",
) -> argparse.ArgumentParser:
    """The argument parser (server flags plus one flag per field of ``options_cls``:
    :class:`MockOptions`, or the vLLM mock's subclass)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--role", choices=("teacher", "student"), default="teacher")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--byte-model-tokenizer",
        metavar="PATH",
        help="serve sampled-token logprobs from a ByteModel over this tokenizer.json's ids "
        "(a file or a directory holding one; the [xtok] extra): the same logprob for a text "
        "in any tokenization, for a teacher with another tokenizer; --vocab-size must hold "
        "its ids",
    )
    p.add_argument(
        "--byte-model-q",
        type=float,
        default=0.5,
        help="the ByteModel's geometric ratio q in (0, 1) (default 0.5)",
    )
    p.add_argument(
        "--byte-model-salt",
        type=int,
        default=0,
        help="the ByteModel's salt: two models of another salt or q differ (default 0)",
    )
    default = options_cls()
    hints = typing.get_type_hints(options_cls)
    for name in options_cls.__struct_fields__:
        flag = "--" + name.replace("_", "-")
        value = getattr(default, name)
        if name == "vocab_size":
            p.add_argument(
                flag,
                dest=name,
                type=int,
                default=CLI_VOCAB_SIZE,
                metavar="V",
                help="token ids accepted: [0, V); others are answered 400 (default "
                f"{CLI_VOCAB_SIZE}: holds the ids of every tokenizer the README names, "
                "Qwen 3.5's 248070 the most)",
            )
        elif name == "masked_ids":
            p.add_argument(flag, dest=name, type=_int_tuple, default=None, help="comma list")
        elif name == "weight_versions":
            p.add_argument(flag, dest=name, type=_str_tuple, default=(), help="comma list")
        elif isinstance(value, bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=value)
        elif typing.get_origin(hints[name]) is typing.Literal:
            p.add_argument(flag, dest=name, choices=typing.get_args(hints[name]), default=value)
        elif value is None:
            p.add_argument(flag, dest=name, type=_NONE_DEFAULT_TYPES[name], default=None)
        else:
            p.add_argument(flag, dest=name, type=type(value), default=value)
    return p


def _byte_model(args: argparse.Namespace, options: MockOptions) -> ByteModel | None:
    """The ByteModel of ``--byte-model-tokenizer``, or None.

    Raises:
        ConfigError: the tokenizer does not load, or its ids do not fit ``--vocab-size``.
        ValueError: a bad ``--byte-model-q``.
    """
    if not args.byte_model_tokenizer:
        return None
    from ..._errors import ConfigError
    from ...xtok._vocab import load_vocab

    vocab = load_vocab("--byte-model-tokenizer", args.byte_model_tokenizer)
    if len(vocab.token_bytes) > options.vocab_size:
        raise ConfigError(
            f"--byte-model-tokenizer: its {len(vocab.token_bytes)} ids do not fit "
            f"--vocab-size {options.vocab_size}"
        )
    return ByteModel(vocab.token_bytes, q=args.byte_model_q, salt=args.byte_model_salt)


def serve(server: ServerBase[Any]) -> int:
    """Serve ``server`` until SIGTERM/SIGINT (the command's life); the exit status: 0, or 2
    with one line on stderr when it cannot listen (e.g. the port is in use)."""
    try:
        asyncio.run(server.serve_until_signalled())
    except OSError as exc:
        print(
            f"error: cannot serve on {server.host}:{server.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGTERM/SIGINT, return the exit status."""
    args = build_parser().parse_args(argv)
    fields = {name: getattr(args, name) for name in MockOptions.__struct_fields__}
    try:
        options = msgspec.convert(fields, MockOptions)
    except (msgspec.ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        byte_model = _byte_model(args, options)
    except ValueError as exc:  # ConfigError included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(
        MockServer(
            args.role, args.seed, options, host=args.host, port=args.port, byte_model=byte_model
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
