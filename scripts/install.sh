#!/usr/bin/env bash
# Install hybridtrain (editable, so conf/ and recipes/ stay next to the code).
#   bash scripts/install.sh          # runtime dependencies
#   bash scripts/install.sh --dev    # plus the test tools
# On a machine without an NVIDIA GPU, torch is installed first as the CPU build
# (torch==$HYBRIDTRAIN_TORCH, default 2.13.0; set TORCH_INDEX_URL, e.g. PyTorch's CPU wheel index,
# if your pip would otherwise pick a CUDA build). With a GPU, or when torch is already installed,
# torch is left to pip (pyproject only asks for torch>=2.4), so GPU users keep their CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
if ! command -v nvidia-smi >/dev/null 2>&1 && ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] no NVIDIA GPU found: installing the CPU build of torch ${HYBRIDTRAIN_TORCH:-2.13.0}"
  "$PY" -m pip install -q "torch==${HYBRIDTRAIN_TORCH:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install -q -e ".${extras}"
echo "[install] hybridtrain installed: $("$PY" -c 'import hybridtrain; print(hybridtrain.__version__)')"
