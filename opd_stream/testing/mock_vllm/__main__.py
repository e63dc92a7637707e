"""CLI: ``python -m opd_stream.testing.mock_vllm --port 0 --role teacher --seed 1 ...``.

The SGLang mock's flags (every :class:`MockOptions` field: faults, latency, capacity, prefix
cache, ``--vocab-size``, ``--byte-model-tokenizer``, ...), plus vLLM's ``--max-logprobs N``
(default 20; -1: the vocabulary), ``--no-prompt-tokens-details`` (answers without
``usage.prompt_tokens_details``) and ``--no-scale-out`` (a server started without
``--enable-scale-out``: ``/inference/v1/generate`` answers 403). ``--context-length`` is
vLLM's ``--max-model-len``. The first line printed is ``listening on http://HOST:PORT``;
SIGTERM/SIGINT stop the server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import msgspec

from ..mock_sglang.__main__ import _byte_model, serve
from ..mock_sglang.__main__ import build_parser as _sglang_parser
from ._app import VllmMockServer
from ._options import VllmMockOptions

__all__ = ("build_parser", "main")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: the SGLang mock's, over :class:`VllmMockOptions`, plus
    ``--no-scale-out``."""
    p = _sglang_parser(
        VllmMockOptions,
        prog="python -m opd_stream.testing.mock_vllm",
        description="Mock vLLM server.",
    )
    p.add_argument(
        "--scale-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve /inference/v1/generate (vllm serve --enable-scale-out; default on); "
        "--no-scale-out answers it 403 as vLLM does",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, serve until SIGTERM/SIGINT, return the exit status."""
    args = build_parser().parse_args(argv)
    fields = {name: getattr(args, name) for name in VllmMockOptions.__struct_fields__}
    try:
        options = msgspec.convert(fields, VllmMockOptions)
        byte_model = _byte_model(args, options)
    except (msgspec.ValidationError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return serve(
        VllmMockServer(
            args.role,
            args.seed,
            options,
            scale_out=args.scale_out,
            host=args.host,
            port=args.port,
            byte_model=byte_model,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
