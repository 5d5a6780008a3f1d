#!/usr/bin/env bash
# Install hybridtrain (editable, so conf/ and recipes/ stay next to the code).
#   bash scripts/install.sh                  # runtime dependencies (torch: see below)
#   bash scripts/install.sh --dev            # plus the test tools
#   bash scripts/install.sh --cuda 12.4      # torch's CUDA 12.4 build, e.g. on a GPU-less login node for
#                                            # the cluster's GPU nodes (any X.Y PyTorch publishes: 12.6, 12.8...)
#   bash scripts/install.sh --cpu            # torch's CPU build, even where a GPU is
#   bash scripts/install.sh --wheels DIR     # offline: every package from the wheels in DIR (pip download them
#                                            # elsewhere: docs/gpu.md); combine with --cuda/--cpu as needed
#   bash scripts/install.sh --dry-run ...    # print the pip commands, run nothing
# Which torch: with --cuda X.Y, the build from PyTorch's index https://download.pytorch.org/whl/cuXY (a CPU
# build already installed is replaced); with --cpu, torch==$HYBRIDTRAIN_TORCH (default 2.13.0) from
# $TORCH_INDEX_URL if set. Without either: on a machine with no NVIDIA GPU (no nvidia-smi) and no torch, the
# CPU build as with --cpu; otherwise torch is left to pip (pyproject only asks for torch>=2.4), so GPU users
# keep their CUDA build. HYBRIDTRAIN_TORCH also pins the version --cuda installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMI=${HYBRIDTRAIN_NVIDIA_SMI:-nvidia-smi}
extras="" cuda="" cpu=0 wheels="" dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) extras="[dev]" ;;
    --cuda) cuda="${2:-}"; shift ;;
    --cuda=*) cuda="${1#--cuda=}" ;;
    --cpu) cpu=1 ;;
    --wheels) wheels="${2:-}"; shift ;;
    --wheels=*) wheels="${1#--wheels=}" ;;
    --dry-run) dry=1 ;;
    *) echo "[install] unknown option $1 (see the top of scripts/install.sh)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$cuda" ] && ! [[ "$cuda" =~ ^[0-9]+\.[0-9]+$ ]]; then
  echo "[install] --cuda wants a CUDA version such as 12.4 (PyTorch's index cu124), got '$cuda'" >&2; exit 2
fi
if [ -n "$cuda" ] && [ "$cpu" = 1 ]; then
  echo "[install] --cuda and --cpu exclude each other" >&2; exit 2
fi
if [ -n "$wheels" ] && [ ! -d "$wheels" ] && [ "$dry" = 0 ]; then
  echo "[install] --wheels $wheels is not a folder" >&2; exit 2
fi

run() {  # a pip command, or its text with --dry-run
  if [ "$dry" = 1 ]; then echo "+ $*"; else "$@"; fi
}
offline=()
[ -n "$wheels" ] && offline=(--no-index --find-links "$wheels")
build=()  # offline, the editable build uses the setuptools already installed (no isolated build env to fetch)
[ -n "$wheels" ] && build=(--no-build-isolation)
pin="torch${HYBRIDTRAIN_TORCH:+==$HYBRIDTRAIN_TORCH}"

if [ -n "$cuda" ]; then
  index="https://download.pytorch.org/whl/cu${cuda//./}"
  echo "[install] torch for CUDA $cuda ($index)"
  # a CPU build satisfies "torch==X" too (2.13.0+cpu): remove it so pip fetches the CUDA one
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)" >/dev/null 2>&1; then
    run "$PY" -m pip uninstall -y -q torch
  fi
  if [ -n "$wheels" ]; then
    run "$PY" -m pip install -q ${offline[@]+"${offline[@]}"} "$pin"
  else
    run "$PY" -m pip install -q "$pin" --index-url "$index"
  fi
elif [ "$cpu" = 1 ] || { ! command -v "$SMI" >/dev/null 2>&1 && ! "$PY" -c "import torch" >/dev/null 2>&1; }; then
  echo "[install] installing the CPU build of torch ${HYBRIDTRAIN_TORCH:-2.13.0}"
  run "$PY" -m pip install -q ${offline[@]+"${offline[@]}"} "torch==${HYBRIDTRAIN_TORCH:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
run "$PY" -m pip install -q ${offline[@]+"${offline[@]}"} ${build[@]+"${build[@]}"} -e ".${extras}"
if [ "$dry" = 0 ]; then
  echo "[install] hybridtrain installed: $("$PY" -c 'import hybridtrain, torch; print(hybridtrain.__version__, "with torch", torch.__version__, "CUDA", torch.version.cuda)')"
fi
