#!/usr/bin/env bash
# The GPU check (one CUDA GPU, under 10 minutes): the gpu-marked tests, the training-step
# benchmark in bf16 with flex attention, and DSpark served by vLLM for the embedded default.
# Writes bench/results/gpu_check/gpu_check.{json,md}. See bench/gpu_check.py for the phases.
#   bench/gpu_check.sh --dry-run        # the plan, runs nothing (works without a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m bench.gpu_check "$@"
