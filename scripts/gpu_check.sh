#!/usr/bin/env bash
# GPU checks of the KL stage, for a session whose task was lent a device machine (an NVIDIA
# H200 with its own python3 3.12 + CUDA torch; nothing can be fetched there). Two steps:
#
#   here (registry access):  bash scripts/gpu_check.sh prepare
#       downloads the cp312 wheels the device image lacks into .whl/ (git-ignored, ~1 MB)
#   on the device (the `device` tool's run, about 3-5 minutes):
#       command: bash scripts/gpu_check.sh run     carry: [".whl"]     timeout_s: 540
#
# `run` writes to $OUT: pytest.log (tests/kl/test_kl*.py, which add a cuda parameter when CUDA
# is present), gpu_check.log (scripts/gpu_check.py: the whole stream on cuda vs cpu, every
# strategy x weight mode, and the KL stage's time per batch on each) and bench/ (scenario 1
# at quick sizes with OPD_STREAM_KL_DEVICE=cuda: results.md has the KL stage table).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
prepare)
    rm -rf .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        msgspec==0.23.0 structlog==26.1.0 trio==0.35.0 outcome==1.3.0.post0 \
        sniffio==1.3.1 anyio==4.16.0
    ls .whl
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/pytest.log"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
        | tee -a "$out/pytest.log"
    status=0
    python3 -m pytest -q tests/kl/test_kl.py tests/kl/test_kl_fastpath.py 2>&1 | tee -a "$out/pytest.log" \
        || status=1
    python3 scripts/gpu_check.py --device cuda 2>&1 | tee "$out/gpu_check.log" || status=1
    OPD_STREAM_KL_DEVICE=cuda python3 -m bench.run --quick --scenario 1 --no-progress \
        --out "$out/bench" 2>&1 | tail -n 40 || status=1
    exit "$status"
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh prepare | run" >&2
    exit 2
    ;;
esac
