#!/usr/bin/env bash
# The GPU check of hybridtrain: everything that fits on ONE GPU, in under 8 minutes, results under
# bench/results/gpu_check_DATE.{md,log,xml} (and gpu_mfu_DATE.{md,json}). docs/gpu.md says what it covers.
#   bash scripts/gpu_check.sh                # needs torch's CUDA build; the rest of hybridtrain's deps installed
#   WHEELS=DIR bash scripts/gpu_check.sh     # first installs missing pure-Python deps offline from DIR
# With $OUT set (the device runner's output folder) the results are copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=$(date +%Y-%m-%d_%H%M%S)
res=bench/results
mkdir -p "$res"
log="$res/gpu_check_$stamp.log"
md="$res/gpu_check_$stamp.md"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HYBRIDTRAIN_TEST_GPU=1 PYTHONUNBUFFERED=1
export HYBRIDTRAIN_CACHE=${HYBRIDTRAIN_CACHE:-${TMPDIR:-/tmp}/hybridtrain-gpu-check-cache}
t0=$(date +%s)
say() { echo "[gpu_check] $*" | tee -a "$log"; }

say "start $stamp in $PWD"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >>"$log" 2>&1 || say "nvidia-smi failed"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$log" 2>&1; then
  say "torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)): install torch's CUDA build first"
  say "(bash scripts/install.sh --cuda 12.8, or pip install from carried wheels: docs/gpu.md)"; exit 2
fi
if ! "$PY" -c "import deepspeed, transformers, hydra, datasets, safetensors, tqdm, psutil" >>"$log" 2>&1; then
  if [ -n "${WHEELS:-}" ]; then
    say "installing missing packages from $WHEELS"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation -e ".[dev]" >>"$log" 2>&1 || { say "offline install failed"; exit 2; }
  else
    say "hybridtrain's dependencies are missing: set WHEELS=DIR (docs/gpu.md) or run scripts/install.sh"; exit 2
  fi
fi
"$PY" - >>"$log" 2>&1 <<'EOF'
import deepspeed, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0), "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__)
EOF
tail -1 "$log"

# 1. The GPU tier without the benchmark (multi-GPU tests skip here with their reason): about 4-5 minutes.
say "tests/gpu (one GPU): up to 330 s"
timeout 330 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu -k "not mfu_benchmark" \
  --junitxml="$res/gpu_check_$stamp.xml" >>"$log" 2>&1
tier=$?
say "tests/gpu exit $tier after $(( $(date +%s) - t0 )) s"

# 2. The single-GPU MFU benchmark (hybridtrain vs a plain transformers loop, 0.9B Llama, bf16), shortened.
left=$(( 450 - ($(date +%s) - t0) ))
if [ "$left" -gt 60 ]; then
  say "bench/gpu_mfu.py: up to $left s"
  timeout "$left" "$PY" bench/gpu_mfu.py --rounds 1 --steps 6 --out "$res" >>"$log" 2>&1
  bench=$?
else
  say "no time left for bench/gpu_mfu.py"; bench=124
fi
say "bench exit $bench after $(( $(date +%s) - t0 )) s"

# 3. Summary.
"$PY" - "$res/gpu_check_$stamp.xml" "$md" "$tier" "$bench" "$stamp" <<'EOF' | tee -a "$log"
import glob, json, sys, xml.etree.ElementTree as ET
xml_path, md, tier, bench, stamp = sys.argv[1:]
lines = [f"# GPU check {stamp}", "", "`bash scripts/gpu_check.sh` (docs/gpu.md).", ""]
try:
    import torch
    lines.append(f"Device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; torch {torch.__version__} "
                 f"(CUDA {torch.version.cuda})")
except Exception as err:  # noqa: BLE001
    lines.append(f"Device: unknown ({err})")
lines += ["", f"tests/gpu exit code {tier}; bench exit code {bench}.", "", "| test | result |", "|---|---|"]
try:
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        what = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                what = f"{tag}: {(node.get('message') or '').splitlines()[0][:160] if node.get('message') else ''}"
        lines.append(f"| {case.get('name')} | {what} |")
except (OSError, ET.ParseError) as err:
    lines.append(f"| (no junit report: {err}) | |")
bench_md = sorted(glob.glob("bench/results/gpu_mfu_*.md"))
if bench_md and int(bench) == 0:
    lines += ["", "MFU benchmark:", "", *open(bench_md[-1]).read().splitlines()[2:]]
open(md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$res"/gpu_check_"$stamp".* "$OUT"/ 2>/dev/null
  cp "$(ls -t "$res"/gpu_mfu_*.md 2>/dev/null | head -1)" "$(ls -t "$res"/gpu_mfu_*.json 2>/dev/null | head -1)" "$OUT"/ 2>/dev/null
fi
say "done in $(( $(date +%s) - t0 )) s: $md"
[ "$tier" = 0 ] && [ "$bench" = 0 ]
