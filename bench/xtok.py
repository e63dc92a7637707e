"""Cross-tokenizer sampled-token scoring next to same-tokenizer sampled-token scoring, in one
run: client CPU per response token (target: cross <= 2x same).

``python -m bench.xtok [--quick] [--n N] [--prompt P] [--response R] [--out DIR]``
(full size: 256 x (512 + 4096); ``--quick``: 16 x (512 + 4096)).

Two mock teachers run as subprocesses (their CPU is not the client's), both serving a
:class:`~opd_stream.testing.mock_sglang.ByteModel` with the same ``q`` and ``salt``: one over
the student's tokenizer (Qwen 3.5), for same-tokenizer scoring of the student's ids, and
one over DeepSeek V3's, for cross-tokenizer scoring (the client re-tokenises each response,
aligns the spans and sends ``teacher_prompt_ids + the teacher's ids``). The samples are the
same for both runs: text of several scripts, code and emoji (the student's ids, rollout
logprobs from the student's byte model); the teacher prompt is the same text in DeepSeek's
ids. As the byte model is the same whatever the tokenization, each sample's summed reverse
KL must agree between the runs (checked, 1e-2: float32 logprobs summed over 4096 tokens;
a response cut inside a character leaves its last span unscored, and so out of the sum).

Each client's CPU (``ClientMeter``: this process, all threads, the decode threads
included) is measured over the run only, the stream (and its tokenizers) already
started. ``stats().cpu_s["align"]`` is the part spent re-tokenising (``encoder``: the
teacher's encoder, ``tiktoken`` when its ``tokenizer.json`` converts exactly, see
:mod:`opd_stream.xtok._encoder`, else ``tokenizers``). The floors, outside this project, on
the same response texts, alone, best of 3: ``encode_floor`` the fastest encoder's own
encoding (``tiktoken``'s ``encode_to_numpy``, or ``tokenizers`` when it is the encoder),
``tokenizers_encode`` that of ``tokenizers`` (``encode_batch_fast``, no offsets);
``align_alone`` the whole alignment of the same responses run alone in one thread (best
of 3). Needs the set-up step's tokenizer files (``.cache/xtok``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from opd_stream import OPDStream, Sample, ScoredSample, StreamConfig
from opd_stream.testing.mock_sglang import ByteModel, MockOptions, MockProcess
from opd_stream.xtok._align import align_response
from opd_stream.xtok._vocab import Vocab, load_vocab

from .harness import ClientMeter, pid_list

__all__ = ("main", "run")

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "xtok"
Q, SALT = 0.5, 7
TEACHER_Q = 0.6
_TEXT = (
    "the quick brown fox jumps over a lazy dog while 你好世界 東京 北京 and Größe café naïve "
    "Привет мир Ελληνικά العربية हिन्दी 🎉 👍🏽 ❤️ def f(x): return x ** 2 # 平方 for i in "
    'range(10): print(i) {"key": [1, 2, 3]} <think> ok </think>'
)
WORDS = _TEXT.split(" ")


def _words(rng: np.random.Generator, student: Vocab, tokens: int) -> str:
    """Random text of at least ``tokens`` student tokens."""
    parts: list[str] = []
    while True:
        parts.extend(rng.choice(WORDS, 64).tolist())
        text = " ".join(parts)
        if student.encode(text).shape[0] >= tokens:
            return text


def make_samples(
    student: Vocab, teacher: Vocab, n: int, prompt: int, response: int
) -> tuple[list[Sample], list[Sample]]:
    """(same-tokenizer samples, cross-tokenizer samples): the same rollouts, the second with
    the teacher prompt (the same text) in the teacher's ids. A prompt is about ``prompt``
    tokens (whole words); a response is exactly ``response`` (it may end inside a
    character)."""
    rng = np.random.default_rng(25)
    model = ByteModel(student.token_bytes, q=Q, salt=SALT)
    same, cross = [], []
    for _ in range(n):
        prompt_text = _words(rng, student, prompt)
        p_ids = student.encode(prompt_text)
        r_ids = student.encode(_words(rng, student, response))[:response]
        tokens = np.concatenate([p_ids, r_ids])
        rollout = model.token_logprobs(tokens, np.arange(p_ids.shape[0], tokens.shape[0]))
        lps = rollout.astype(np.float32)
        same.append(Sample(tokens=tokens, response_length=response, rollout_logprobs=lps))
        cross.append(
            Sample(
                tokens=tokens,
                response_length=response,
                rollout_logprobs=lps,
                teacher_prompt_ids=teacher.encode(prompt_text),
            )
        )
    return same, cross


def _cpu(fn: Any) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


async def _measure(
    cfg: StreamConfig, samples: list[Sample], pids: list[int]
) -> tuple[dict[int, ScoredSample], float, Any]:
    out: dict[int, ScoredSample] = {}
    async with OPDStream(cfg) as stream:
        # warm-up (connections, compiled kernels), not measured
        async with stream.run(samples[:2]) as results:
            async for _ in results:
                pass
        with ClientMeter(pids) as meter:
            async with stream.run(samples) as results:
                async for item in results:
                    if not isinstance(item, ScoredSample):
                        raise RuntimeError(f"sample {item.index} failed: {item.message}")
                    out[item.index] = item
        stats = stream.stats()
    return out, meter.cpu_s, stats


async def run(n: int, prompt: int, response: int) -> dict[str, Any]:
    """Both runs; the numbers (CPU per response token, their ratio, the check)."""
    qwen, ds = CACHE / "qwen-3.5", CACHE / "deepseek-v3"
    if not (qwen / "tokenizer.json").is_file() or not (ds / "tokenizer.json").is_file():
        raise SystemExit(f"{CACHE} lacks the tokenizer files: run scripts/dev.sh setup")
    student = load_vocab("student_tokenizer", str(qwen))
    teacher = load_vocab("teacher_tokenizers[default]", str(ds))
    same, cross = make_samples(student, teacher, n, prompt, response)
    opts = MockOptions(vocab_size=262144)

    def proc(path: Path) -> MockProcess:
        extra = ["--byte-model-tokenizer", str(path), "--byte-model-q", str(TEACHER_Q)]
        extra += ["--byte-model-salt", str(SALT)]
        return MockProcess("teacher", 1, options=opts, extra_args=extra, startup_timeout=120)

    procs = [proc(qwen), proc(ds)]
    try:
        for p in procs:
            p.start()
        pids = pid_list(procs)
        base: dict[str, Any] = {"teachers": procs[0].url, "kl_device": "cpu"}
        same_out, same_cpu, same_stats = await _measure(
            StreamConfig.from_env({}, **base), same, pids
        )
        xcfg = StreamConfig.from_env(
            {},
            teachers=procs[1].url,
            kl_device="cpu",
            student_tokenizer=str(qwen),
            teacher_tokenizers=str(ds),
            return_alignment=True,
        )
        cross_out, cross_cpu, cross_stats = await _measure(xcfg, cross, pids)
    finally:
        for p in procs:
            p.kill()
    texts = [
        student.join(np.asarray(x.tokens)[-response:]).decode("utf-8", errors="ignore")
        for x in cross
    ]
    # the encoders alone, outside this project: the fastest one (tiktoken, when the
    # teacher's tokenizer converts exactly: opd_stream.xtok._encoder) and tokenizers itself
    fast = teacher.fast
    if fast is not None:
        enc, allowed = fast.encoding, fast.allowed
        floor = min(
            _cpu(
                lambda: [
                    enc.encode_to_numpy(t, allowed_special=allowed, disallowed_special=())
                    for t in texts
                ]
            )
            for _ in range(3)
        )
    ref = min(_cpu(lambda: [teacher.encode_reference(t) for t in texts]) for _ in range(3))
    if fast is None:
        floor = ref
    # the whole alignment (ours: bytes, encode, round-trip check, spans), alone, in this
    # thread: beside cpu_s["align"] (the same work in the pipeline's decode threads)
    responses = [np.asarray(x.tokens)[-response:] for x in cross]
    alone = min(
        _cpu(lambda: [align_response(student, teacher, r, "t") for r in responses])
        for _ in range(3)
    )
    worst = 0.0
    for i in range(n):
        al = cross_out[i].alignment
        assert al is not None
        # the tokens the cross run compared (a final character cut short is not)
        end = int(al.student_spans[1:][al.scored].max()) if bool(al.scored.any()) else 0
        a = float(same_out[i].reverse_kl[:end].double().sum())  # type: ignore[index]
        b = float(cross_out[i].reverse_kl.double().sum())  # type: ignore[union-attr]
        worst = max(worst, abs(a - b))
    tokens = n * response
    result = {
        "sizes": {"n": n, "prompt": prompt, "response": response},
        "same_cpu_us_per_token": same_cpu / tokens * 1e6,
        "cross_cpu_us_per_token": cross_cpu / tokens * 1e6,
        "ratio": cross_cpu / same_cpu,
        "target_ratio": 2.0,
        "align_cpu_us_per_token": cross_stats.cpu_s.align / tokens * 1e6,
        "encoder": teacher.encoder,
        "encode_floor_us_per_token": floor / tokens * 1e6,
        "tokenizers_encode_us_per_token": ref / tokens * 1e6,
        "align_alone_us_per_token": alone / tokens * 1e6,
        # the ratio if re-tokenising cost only the fastest encoder's own encoding
        "floor_ratio": (same_cpu + floor) / same_cpu,
        # the same with tokenizers as the encoder
        "tokenizers_floor_ratio": (same_cpu + ref) / same_cpu,
        "cpu_s_by_step": {"same": same_stats.cpu_s.as_dict(), "cross": cross_stats.cpu_s.as_dict()},
        "summed_reverse_kl_max_difference": worst,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.xtok", description=__doc__)
    p.add_argument("--quick", action="store_true", help="16 x (512 + 4096)")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=4096)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    n = args.n if args.n is not None else (16 if args.quick else 256)
    # The compiled kernels once, before anything is measured (as bench.run does).
    from opd_stream.scanner._loader import prepare

    prepare()
    result = asyncio.run(run(n, args.prompt, args.response))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "xtok.json").write_text(json.dumps(result, indent=2) + "\n")
    verdict = "MET" if result["ratio"] <= result["target_ratio"] else "MISSED"
    print(
        f"cross-tokenizer {result['cross_cpu_us_per_token']:.2f} us/token, same-tokenizer "
        f"{result['same_cpu_us_per_token']:.2f} us/token: ratio {result['ratio']:.2f} "
        f"(target <= 2: {verdict}); re-tokenisation {result['align_cpu_us_per_token']:.2f} "
        f"us/token with the {result['encoder']} encoder, whose own encoding alone (floor) is "
        f"{result['encode_floor_us_per_token']:.2f} (floor ratio {result['floor_ratio']:.2f}; "
        f"tokenizers' encoding alone {result['tokenizers_encode_us_per_token']:.2f}, floor "
        f"ratio {result['tokenizers_floor_ratio']:.2f}; our whole alignment alone "
        f"{result['align_alone_us_per_token']:.2f}); "
        "summed reverse KL agrees within "
        f"{result['summed_reverse_kl_max_difference']:.2e}",
        file=sys.stderr,
    )
    return 0 if result["summed_reverse_kl_max_difference"] <= 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
