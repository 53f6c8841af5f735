#!/usr/bin/env bash
# Snakemake runs this inside envs/gpu.yaml's environment right after creating it
# (`--sdm conda`). flash-attn builds against the env's torch, so without build isolation;
# it downloads a matching prebuilt wheel when one exists, else compiles (needs nvcc; MAX_JOBS
# bounds the compiler's memory). KVSHOT_SKIP_FLASH_ATTN=1 skips it: the target then uses SDPA.
set -euo pipefail
FLASH_ATTN_PIN="flash-attn==2.8.3.post2"   # = pyproject's [gpu] extra (tests/test_envs.py checks)
if [ "${KVSHOT_SKIP_FLASH_ATTN:-0}" = 1 ]; then
  echo "gpu.post-deploy.sh: KVSHOT_SKIP_FLASH_ATTN=1: no flash-attn (attention falls back to SDPA)"
  exit 0
fi
python -m pip install --no-build-isolation --no-deps "$FLASH_ATTN_PIN"
python -c "import flash_attn; print('flash-attn', flash_attn.__version__)"
