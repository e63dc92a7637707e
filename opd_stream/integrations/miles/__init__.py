"""Miles / slime drop-in: ``reward_func`` and ``post_process_rewards`` backed by one shared
:class:`~opd_stream.OPDStream`. Point Miles at this module instead of
``miles.rollout.on_policy_distillation``::

    --use-opd --opd-type sglang --rm-url http://teacher:30000/generate \\
    --custom-rm-path opd_stream.integrations.miles.reward_func \\
    --custom-reward-post-process-path opd_stream.integrations.miles.post_process_rewards

The reference's flags keep their meaning, other fields come from ``OPD_STREAM_*``
(:func:`config_from_miles_args`); each ``reward_func`` call is one :meth:`OPDStream.score` on
a shared :class:`MilesEngine` (:func:`close` it when training ends). Results and errors as
the reference's: ``docs/design-notes.md``, "opd_stream/integrations/miles/__init__.py".
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ..._sample import SampleFailure, ScoredSample
from ...config._settings import StreamConfig
from ...transport._transports import Transport
from ._engine import (
    TEACHER_PROMPT_KEY,
    MilesEngine,
    MilesInvalidSampleError,
    MilesRoutingError,
    MilesTimeoutError,
    OPDSampleError,
    sample_error,
)
from ._flags import config_from_miles_args

if TYPE_CHECKING:
    import torch

__all__ = (
    "MilesEngine",
    "MilesInvalidSampleError",
    "MilesRoutingError",
    "MilesTimeoutError",
    "OPDSampleError",
    "TEACHER_PROMPT_KEY",
    "close",
    "config_from_miles_args",
    "engine_for",
    "sample_error",
    "post_process_rewards",
    "reward_func",
)

_RESULT_KEY: Final = "opd_stream"


_ENGINES: dict[tuple[int, bytes], MilesEngine] = {}


def _config_key(config: StreamConfig) -> bytes:
    values = config.to_log_dict()
    if config.api_key is not None:
        values["api_key"] = config.api_key.get_secret_value()  # in-memory key only
    return msgspec.json.encode(values)


def engine_for(args: Any, *, transport: Transport | None = None) -> MilesEngine:
    """The shared engine for ``args`` on the running loop (created on first use).

    Args:
        args: Miles' arguments (see :func:`config_from_miles_args`).
        transport: used only when the engine is created here (tests pass a fake one).
    """
    loop = asyncio.get_running_loop()
    for stale in [k for k, e in _ENGINES.items() if e.loop is not None and e.loop.is_closed()]:
        del _ENGINES[stale]
    config = config_from_miles_args(args)
    key = (id(loop), _config_key(config))
    engine = _ENGINES.get(key)
    if engine is None or engine.loop not in (None, loop):
        engine = _ENGINES[key] = MilesEngine(config, transport=transport)
    return engine


async def close() -> None:
    """Close every engine of the running loop (call once when rollouts are over)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _ENGINES if k[0] == id(loop)]:
        await _ENGINES.pop(key).aclose()


def _as_float32(values: torch.Tensor) -> torch.Tensor:
    import torch

    return values.detach().to(device="cpu", dtype=torch.float32)


async def reward_func(args: Any, sample: Any, **kwargs: Any) -> dict[str, Any]:
    """Score one sample (Miles' ``reward_func`` signature).

    Returns:
        ``{"teacher_log_probs": float32 [R]}`` in sampled-token mode (a teacher with
        another tokenizer: ``rollout_log_probs - signal``, see the module docstring), or
        ``{"opd_reverse_kl": float32 [R]}`` in top-k mode (the signal of the configured
        ``divergence``, reverse KL by default: the name is the one Miles' trainer reads),
        plus ``"opd_stream"``: the teacher name, attempts and latency (and the divergence
        in top-k mode).

    Raises:
        MilesRoutingError: (a ``ValueError``) the sample's teacher key is missing or
            unknown and there is no ``default`` teacher; the reference's wording.
        MilesInvalidSampleError: (a ``ValueError``) the sample is invalid, or a selected
            candidate has no logprob.
        MilesTimeoutError: (a ``TimeoutError``) a request ran past its deadline.
        OPDSampleError: any other failure (its ``reason`` says why: ``teacher_http_503``,
            ``misaligned_response``, ...); the reference raises on any failed request too.
        ConfigError: (a ``ValueError``) the flags or ``OPD_STREAM_*`` variables are invalid.
    """
    del kwargs
    engine = engine_for(args)
    result = await engine.score(sample)
    if isinstance(result, SampleFailure):
        raise sample_error(result)
    out: dict[str, Any] = {
        _RESULT_KEY: {
            "teacher": result.teacher,
            "attempts": result.attempts,
            "latency_s": result.latency_s,
        }
    }
    if engine.config.top_k > 0:
        # the configured divergence's signal, under the name Miles' trainer reads
        assert result.signal is not None
        out["opd_reverse_kl"] = _as_float32(result.signal)
        out[_RESULT_KEY]["divergence"] = result.divergence
    elif result.teacher in (engine.config.teacher_tokenizers or {}):
        out["teacher_log_probs"] = _trainer_teacher_logprobs(result)
    else:
        out["teacher_log_probs"] = _as_float32(result.teacher_logprobs)
    return out


def _trainer_teacher_logprobs(result: ScoredSample) -> torch.Tensor:
    """A teacher with its own tokenizer, sampled-token mode: ``rollout_log_probs -
    reverse_kl``, so that Miles' trainer, which takes ``student_logp - teacher_log_probs``
    per token, gets each span's value on the span's last token and 0 on every other
    (inner tokens of a span, textless tokens, masked tokens), with ``student_logp`` =
    ``rollout_log_probs`` (on-policy; see the module docstring). float64 differences,
    float32 result."""
    import numpy as np
    import torch

    rollout = result.sample.rollout_logprobs
    assert rollout is not None  # required by the engine, as are the span values
    assert result.reverse_kl is not None
    rkl = result.reverse_kl.detach().to(device="cpu", dtype=torch.float64).numpy()
    values = np.asarray(rollout, dtype=np.float64) - rkl
    return torch.from_numpy(values.astype(np.float32))


def _reward_of(args: Any, sample: Any) -> Mapping[str, Any]:
    getter = getattr(sample, "get_reward_value", None)
    value = getter(args) if callable(getter) else getattr(sample, "reward", None)
    if not (isinstance(value, Mapping) and _RESULT_KEY in value):
        value = getattr(sample, "reward", None)
    if not (isinstance(value, Mapping) and _RESULT_KEY in value):
        raise ValueError(
            "post_process_rewards: a sample's reward is not an opd_stream reward_func "
            "result (set --custom-rm-path opd_stream.integrations.miles.reward_func)"
        )
    return value


def post_process_rewards(
    args: Any, samples: Sequence[Any], **kwargs: Any
) -> tuple[list[float], list[float]]:
    """Attach the OPD signal to each sample (Miles' ``post_process_rewards`` signature).

    Sets ``sample.opd_reverse_kl`` (top-k mode) or ``sample.teacher_log_probs``
    (sampled-token mode), float32 ``[R]``, from the dict :func:`reward_func` returned
    (read with ``sample.get_reward_value(args)`` when the sample has it, else
    ``sample.reward``). Returns ``(raw, processed)`` scalar rewards: zeros, as the
    reference (pure OPD).

    Raises:
        ValueError: a sample's reward is not a :func:`reward_func` result, or its signal
            length is not the sample's ``response_length``.
    """
    del kwargs
    for sample in samples:
        reward = _reward_of(args, sample)
        name = "opd_reverse_kl" if "opd_reverse_kl" in reward else "teacher_log_probs"
        values = reward[name]
        if int(values.shape[0]) != int(sample.response_length):
            raise ValueError(
                f"post_process_rewards: {name} has {int(values.shape[0])} values for a "
                f"response of {int(sample.response_length)} tokens"
            )
        setattr(sample, name, values)
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
