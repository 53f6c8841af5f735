#!/usr/bin/env bash
# Snakemake runs this inside envs/gpu.yaml's environment right after creating it
# (`--sdm conda`). flash-attn is optional: the target uses it when it imports and falls back to
# SDPA otherwise (kvshot.target.attn_implementation), so nothing here fails the env's creation.
# It is installed only when it can be: from a prebuilt wheel matching this env's torch, CUDA and
# Python (KVSHOT_FLASH_ATTN_WHEEL: a wheel URL or file to use instead of the guessed release
# asset), or, with nvcc and CUDA_HOME present (gpu.yaml provides neither: a CUDA module or
# toolkit on the node), built against the env's torch without build isolation (MAX_JOBS bounds
# the compiler's memory). A build that installs but does not import is removed again.
# KVSHOT_SKIP_FLASH_ATTN=1 skips it: the target then uses SDPA. The last line says which
# attention the target will use.
set -uo pipefail   # no -e: a flash-attn step that fails is reported, not fatal
FLASH_ATTN_PIN="flash-attn==2.8.3.post2"   # = pyproject's [gpu] extra (tests/test_envs.py checks)
FLASH_ATTN_VERSION="${FLASH_ATTN_PIN#flash-attn==}"
say() { echo "gpu.post-deploy.sh: $*"; }

# the import check the target makes (kvshot.target.flash_attn_problem): flash-attn or why not
attention() {
  python - <<'EOF'
try:
    import flash_attn
except Exception as exc:
    first = (str(exc).strip().splitlines() or ["no message"])[0][:300]
    print(f"sdpa (flash-attn does not import: {type(exc).__name__}: {first})")
else:
    print(f"flash_attention_2 (flash-attn {getattr(flash_attn, '__version__', '?')})")
EOF
}

# the release asset flash-attn's own setup.py looks for: +cu<major>torch<M.m>cxx11abi<ABI>-cpXY
guessed_wheel() {
  python - "$FLASH_ATTN_VERSION" <<'EOF'
import platform, sys
import torch
if not torch.version.cuda:
    sys.exit(0)   # a CPU torch: no CUDA wheel fits it
ver, py = sys.argv[1], f"cp{sys.version_info.major}{sys.version_info.minor}"
tv = ".".join(torch.__version__.split("+")[0].split(".")[:2])
abi = str(torch._C._GLIBCXX_USE_CXX11_ABI).upper()
name = (f"flash_attn-{ver}+cu{torch.version.cuda.split('.')[0]}torch{tv}cxx11abi{abi}"
        f"-{py}-{py}-linux_{platform.machine()}.whl")
print(f"https://github.com/Dao-AILab/flash-attention/releases/download/v{ver}/{name}")
EOF
}

install_flash_attn() {
  local wheel="${KVSHOT_FLASH_ATTN_WHEEL:-$(guessed_wheel 2>/dev/null)}"
  if [ -n "$wheel" ]; then
    say "trying the prebuilt wheel $wheel"
    if python -m pip install --no-deps --retries 1 --timeout 30 "$wheel"; then
      return 0
    fi
    say "no prebuilt flash-attn wheel for this torch/CUDA/Python"
  fi
  local home="${CUDA_HOME:-}" nvcc_cuda torch_cuda
  if [ -z "$home" ] && command -v nvcc >/dev/null 2>&1; then   # the toolkit of the nvcc on PATH
    home="$(nvcc --dryrun -v x.cu 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1)"   # its bin/, through wrappers
    home="${home%/bin}"
  fi
  if [ -z "$home" ] || [ ! -x "$home/bin/nvcc" ] || [ ! -f "$home/include/cuda_runtime.h" ]; then
    say "no nvcc/CUDA_HOME to build flash-attn from source: skipped"
    return 1
  fi
  nvcc_cuda="$("$home/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p')"
  torch_cuda="$(python -c 'import torch; print((torch.version.cuda or "none").split(".")[0])' 2>/dev/null)"
  if [ "$nvcc_cuda" != "$torch_cuda" ]; then
    say "$home/bin/nvcc is CUDA ${nvcc_cuda:-?}, torch is built for CUDA ${torch_cuda:-?}: flash-attn not built"
    return 1
  fi
  say "building $FLASH_ATTN_PIN with $home/bin/nvcc (MAX_JOBS=${MAX_JOBS:=4})"
  CUDA_HOME="$home" MAX_JOBS="$MAX_JOBS" \
    python -m pip install --no-build-isolation --no-deps "$FLASH_ATTN_PIN"
}

if [ "${KVSHOT_SKIP_FLASH_ATTN:-0}" = 1 ]; then
  say "KVSHOT_SKIP_FLASH_ATTN=1: no flash-attn (attention falls back to SDPA)"
elif install_flash_attn; then
  if ! python -c "import flash_attn" >/dev/null 2>&1; then
    say "flash-attn installed but does not import: removing it"
    python -m pip uninstall -y flash-attn || true
  fi
else
  say "no flash-attn installed"
fi
say "target attention (target.attn_implementation: auto): $(attention)"
exit 0
