#!/usr/bin/env bash
# The GPU check (one CUDA GPU, under 10 minutes): the gpu-marked tests, the training-step
# benchmark in bf16 with flex attention, speculative decoding against plain decoding, and DSpark
# served by vLLM for the embedded default (skipped, with the reason, where vLLM is not installed).
# Writes bench/results/gpu_check/gpu_check.{json,md}. See bench/gpu_check.py for the phases.
#   bench/gpu_check.sh --dry-run        # the plan, runs nothing (works without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
# PYTHON: the interpreter (default: the checkout's .venv, else python3 on PATH).
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" -m bench.gpu_check "$@"
