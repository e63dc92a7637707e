"""``opd-stream probe``: :meth:`OPDStream.probe` from the command line.

Prints the :class:`~opd_stream.ProbeReport` as one JSON object (plus ``"ok"``) on stdout;
each replica's entry names its engine (``sglang``, ``vllm``, ``vllm-completions``:
configured, or detected by the probe under ``--engine auto``).
Exit status: 0 when every replica answered within the tolerance, 1 when one is named
(outlier) or failed, 2 on a usage or configuration error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import msgspec

from .._errors import ConfigError, InvalidSampleError
from .._logging import LOG_LEVELS
from .._sample import Sample
from ..config._settings import StreamConfig
from ..fleet._routing import normalize_teachers
from ._score_options import add_engine_arguments, engine_overrides, flag_teachers

__all__ = ("add_probe_arguments", "run_probe_command")

_TEACHERS_VAR = "OPD_STREAM_TEACHERS"


def add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """Declare the options of ``opd-stream probe`` on ``p``."""
    p.add_argument(
        "--teacher",
        action="append",
        metavar="NAME=URL",
        help="a teacher server (repeatable); replicas joined with '|'; a weighted ensemble "
        "as NAME=W*URLS;W*URLS (each member's replicas are probed); a value without a name "
        "is the teacher 'default'; required unless OPD_STREAM_TEACHERS is set (the flags "
        "then replace it)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        metavar="NATS",
        help="largest logprob difference accepted (default: probe_tolerance, 0.1)",
    )
    p.add_argument(
        "--tokens",
        metavar="IDS",
        help="the probe request's token ids, comma-separated (default: a fixed 64-token "
        "sequence); with --response-length",
    )
    p.add_argument(
        "--response-length",
        type=int,
        metavar="R",
        help="positions of --tokens scored (its last R)",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        metavar="SECONDS",
        help="how long each replica's two probe requests may take together; a replica that "
        "has not answered by then is reported (deadline_exceeded) and named (default: "
        "probe_deadline_s, 10)",
    )
    add_engine_arguments(p)
    p.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="read the API key from environment variable VAR (never from the command line)",
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,  # keeps a value given before the sub-command
        help="structlog level, also accepted before 'probe' (default warning)",
    )


class _Usage(Exception):
    pass


def _config(args: argparse.Namespace) -> StreamConfig:
    overrides: dict[str, Any] = {"kl_device": "cpu", "probe_at_start": False}
    if args.teacher:
        try:
            overrides["teachers"] = flag_teachers(args.teacher)
        except ConfigError as exc:
            raise _Usage(f"--teacher: {exc}") from None
    elif _TEACHERS_VAR in os.environ:
        try:
            overrides["teachers"] = normalize_teachers(os.environ[_TEACHERS_VAR].strip())
        except ConfigError as exc:
            raise _Usage(f"{_TEACHERS_VAR}: {exc}") from None
    else:
        raise _Usage(f"--teacher is required (or set {_TEACHERS_VAR})")
    if args.tolerance is not None:
        overrides["probe_tolerance"] = args.tolerance
    if args.deadline_s is not None:
        overrides["probe_deadline_s"] = args.deadline_s
    overrides.update(engine_overrides(args))
    if args.api_key_env is not None:
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise _Usage(
                f"--api-key-env: environment variable {args.api_key_env} is not set or empty"
            )
        overrides["api_key"] = key
    try:
        return StreamConfig.from_env(**overrides)
    except ConfigError as exc:
        raise _Usage(f"configuration: {exc}") from None


def _sample(args: argparse.Namespace) -> Sample | None:
    if args.tokens is None and args.response_length is None:
        return None
    if args.tokens is None or args.response_length is None:
        raise _Usage("--tokens and --response-length go together")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise _Usage("--tokens: expected comma-separated integer ids") from None
    return Sample(tokens, args.response_length)


async def run_probe_command(args: argparse.Namespace) -> int:
    """Run ``opd-stream probe`` with parsed ``args``; return the exit code."""
    from .._stream import OPDStream

    try:
        cfg = _config(args)
        sample = _sample(args)
        async with OPDStream(cfg) as stream:
            report = await stream.probe(sample)
    except (_Usage, ConfigError) as exc:
        print(f"opd-stream probe: error: {exc}", file=sys.stderr)
        return 2
    except InvalidSampleError as exc:
        print(f"opd-stream probe: error: the probe sample: {exc}", file=sys.stderr)
        return 2
    out = msgspec.to_builtins(report)
    out["ok"] = report.ok
    sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    sys.stdout.flush()
    return 0 if report.ok else 1
