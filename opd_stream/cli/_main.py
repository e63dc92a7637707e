"""The ``opd-stream`` command: ``demo`` (the main job), ``score``, ``probe``, ``config``.

The benchmarks are not a command of the installed package: ``scripts/dev.sh bench`` runs
``bench/`` from a source checkout."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence

# Nothing of the package is imported before main() runs: a Ctrl-C at any moment of the
# start-up is then one line and exit 130 (main catches it), never a traceback.

__all__ = ("main",)

_COMMANDS = ("demo", "score", "probe", "config")

_DESCRIPTION = (
    "Streaming teacher scoring for on-policy distillation against SGLang servers. "
    "demo: score rollouts against embedded mock SGLang or vLLM servers (the main job); "
    "score: score a JSON Lines file of rollouts against real servers; "
    "probe: ask every teacher replica the same request, cold and warm, and report how far "
    "their logprobs are apart; "
    "config: print the configuration table."
)


def _parser() -> argparse.ArgumentParser:
    from .. import __version__
    from .._logging import LOG_LEVELS
    from ._demo import add_demo_arguments
    from ._probe import add_probe_arguments
    from ._score_options import add_score_arguments

    p = argparse.ArgumentParser(prog="opd-stream", description=_DESCRIPTION)
    p.add_argument("--version", action="version", version=f"opd-stream {__version__}")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=LOG_LEVELS,
        help="structlog level (default warning)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="score rollouts against embedded mock SGLang or vLLM servers",
        description="Score rollouts against mock SGLang or vLLM servers started by the command "
        "(subprocesses), and check a few results against the mock's closed form.",
    )
    add_demo_arguments(demo)
    score = sub.add_parser(
        "score",
        help="score a JSON Lines file of rollouts against real SGLang servers",
        description="Score a JSON Lines file of rollouts against real SGLang servers "
        "(one output line per input line; docs/cli.md in the repository has both line "
        "schemas). Every StreamConfig field not set by a flag comes from its OPD_STREAM_* "
        "variable.",
    )
    add_score_arguments(score)
    probe = sub.add_parser(
        "probe",
        help="check that every teacher replica gives the same logprobs, cold and warm",
        description="Send the same scoring request to every replica of every teacher, "
        "cold (a fresh cache_salt) and warm (the same request again), and print the "
        "largest logprob difference between replicas and between cold and warm, naming "
        "the replicas beyond the tolerance (JSON on stdout; exit 1 when one is named or "
        "failed). Every StreamConfig field not set by a flag comes from its OPD_STREAM_* "
        "variable.",
    )
    add_probe_arguments(probe)
    sub.add_parser(
        "config",
        help="print the configuration table (fields, env variables) and the answer parser",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The ``opd-stream`` command; the exit code (130 after Ctrl-C, at any moment).

    Returns once the answer scanner's background thread has ended (see :func:`_settle`)."""
    try:
        try:
            return _main(argv)
        finally:
            _settle()
    except KeyboardInterrupt:
        args = sys.argv[1:] if argv is None else list(argv)
        command = next((a for a in args if a in _COMMANDS), None)
        print(f"opd-stream{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:

    from .._errors import ConfigError
    from .._logging import configure_logging
    from ..config._settings import render_config_table

    parser = _parser()
    args = parser.parse_args(argv)
    # score writes every failure to its output, and names its line in its own event
    configure_logging(
        args.log_level, drop_events=("sample_failed",) if args.command == "score" else ()
    )
    if args.command == "config":
        from ._parser_notice import parser_line

        print(render_config_table())
        print(parser_line())
        return 0
    if args.command == "probe":
        from ._probe import run_probe_command

        return _run(args.command, run_probe_command, args)
    _announce_compile(args.command)
    if args.command == "score":
        from ._score import run_score

        return _run(args.command, run_score, args)
    from ._demo import run_demo

    try:
        return _run(args.command, run_demo, args)
    except ConfigError as exc:
        print(f"opd-stream demo: error: configuration: {exc}", file=sys.stderr)
        return 2


def _run(
    command: str,
    func: Callable[[argparse.Namespace], Awaitable[int]],
    args: argparse.Namespace,
) -> int:
    """A command's coroutine on a new event loop; its exit code, 130 after Ctrl-C (which
    wakes the loop wherever it lands: :mod:`._wakeup`)."""
    import anyio

    from ._wakeup import run_woken_by_signals

    try:
        return anyio.run(run_woken_by_signals, func, args)
    except KeyboardInterrupt:
        print(f"opd-stream {command}: interrupted", file=sys.stderr)
        return 130


def _settle() -> None:
    """Let the answer scanner's background thread end before the interpreter does: Python
    running there during the interpreter's shutdown can abort the process (exit 134; see
    :func:`opd_stream.scanner._loader.settle`). A compile running apart is not waited for."""
    from ..scanner._loader import settle

    settle()


def _announce_compile(command: str) -> None:
    """One line on stderr when the answer scanner compiles for the first time (its cache is
    cold); a run never waits for it."""
    from ..scanner._loader import announce_compile

    def notice() -> None:
        print(
            f"opd-stream {command}: compiling the answer scanner for the first time, in the "
            "background (~10 s of CPU, once); msgspec parses the answers until it is ready",
            file=sys.stderr,
            flush=True,
        )

    announce_compile(notice)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
