#!/usr/bin/env bash
# The GPU check of hybridtrain: everything that fits on ONE GPU, in under 8 minutes, on a bare machine that
# reaches no package index (docs/gpu.md, "The GPU check", says what it covers and how to run it).
#   bash scripts/gpu_check.sh                  # on the GPU machine; installs .gpu_wheels when it is there
#   bash scripts/gpu_check.sh --dry-run        # on a CPU machine: every GPU test skips, the plumbing runs
# Options: --wheels DIR (the folder of scripts/gpu_wheels.sh; default .gpu_wheels if present, none in a dry
# run), --results DIR (default bench/results), --workers N (pytest-xdist workers of the tier; default 4, 2 dry),
# --install-only (step 1 alone). For the script's own test (tests/dist/test_gpu_check_script.py):
# GPU_CHECK_TESTS (the tier's tests), GPU_CHECK_BENCH (the benchmark's), GPU_CHECK_TEST_TIMEOUT (seconds a
# test), GPU_CHECK_BUDGET_S (the whole check), GPU_CHECK_BENCH_S (kept for the benchmark), GPU_CHECK_SITE.
# 1. installs the folder's wheels with `pip install --no-deps --no-index --target SITE` (nothing else, no
#    build) and puts SITE first on PYTHONPATH; checks that they import from there and that hybridtrain
#    accepts the versions; 2. the tests/gpu tier but the benchmark (tests needing 2 or 8 GPUs skip with
#    their reason); 3. the benchmark test (alone on the GPU). Every test's verdict is written the moment it
#    ends (verdicts.jsonl, tests/gpu/conftest.py), pytest-timeout stops a hung test, each part has a time
#    limit, and every process the check started is killed after each part (the ranks run in sessions of
#    their own, so they are found by a marker in their environment). Results: RESULTS/gpu_check_DATE/
#    (copied to $OUT/ when set); the summary printed at the end is what to paste into docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dry=0 install_only=0 wheels="" results=bench/results workers=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --wheels) wheels=$2; shift ;;
    --results) results=$2; shift ;;
    --workers) workers=$2; shift ;;
    --install-only) install_only=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "[gpu_check] unknown option $1 (see: bash scripts/gpu_check.sh --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -z "$wheels" ] && [ "$dry" = 0 ] && [ -d .gpu_wheels ] && wheels=.gpu_wheels
[ -z "$workers" ] && workers=$([ "$dry" = 1 ] && echo 2 || echo 4)
stamp=$(date -u +%Y-%m-%d_%H%M%S)
dir="$results/gpu_check_$stamp$([ "$dry" = 1 ] && echo _dry)"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
log="$dir/check.log"
verdicts="$dir/verdicts.jsonl"
: >"$verdicts"
t0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-440}  # the whole check but its summary, seconds (the device call: timeout_s=480)
say() { echo "[gpu_check] $*" | tee -a "$log"; }
elapsed() { echo $(( $(date +%s) - t0 )); }

# Every process started from here on carries this marker in its environment; reap() ends them by pid.
export HYBRIDTRAIN_GPU_CHECK_ID="$stamp.$$"
reap() {  # shell builtins only: a helper process would carry the marker too
  local pids=() f pid entry
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}; pid=${pid%/environ}
    [ "$pid" = "$$" ] && continue
    while IFS= read -r -d '' entry; do
      [ "$entry" = "HYBRIDTRAIN_GPU_CHECK_ID=$HYBRIDTRAIN_GPU_CHECK_ID" ] && { pids+=("$pid"); break; }
    done 2>/dev/null <"$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  say "ending ${#pids[@]} process(es) left running: ${pids[*]}"
  kill -TERM "${pids[@]}" 2>/dev/null; sleep 3; kill -KILL "${pids[@]}" 2>/dev/null
  return 0
}
trap 'reap' EXIT
trap 'say "interrupted"; exit 130' INT TERM

# run_part NAME SECONDS CMD...: CMD under `timeout`, which makes a process group of its own and signals the
# whole group at the limit; output to NAME.log. Then the group is killed (anything left in it) and so is
# whatever the part left elsewhere (ranks run in sessions of their own: reap)
run_part() {
  local name=$1 limit=$2 rc pid; shift 2
  [ "$limit" -lt 10 ] && limit=10
  say "$name: up to $limit s"
  timeout -k 15 "$limit" "$@" </dev/null >"$dir/$name.log" 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && say "$name: stopped at its limit of $limit s"
  reap
  say "$name: exit $rc after $(elapsed) s"
  return "$rc"
}

say "start $stamp in $PWD$([ "$dry" = 1 ] && echo ' (dry run: no GPU needed, every GPU test skips)')"
{ nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >>"$log" 2>&1 \
  || say "nvidia-smi: none here"

if [ "$dry" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$log"; then
  say "torch sees no CUDA device: this check needs torch's CUDA build and a GPU (--dry-run runs without)"; exit 2
fi

# 1. the carried wheels: installed into SITE and first on PYTHONPATH; nothing else is installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "$wheels" ]; then
  shopt -s nullglob
  whl=("$wheels"/*.whl)
  shopt -u nullglob
  [ ${#whl[@]} -gt 0 ] || { say "no wheels in $wheels (bash scripts/gpu_wheels.sh makes them)"; exit 2; }
  site=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/gpu_check_site_$stamp}
  rm -rf "$site"
  say "installing ${#whl[@]} wheels from $wheels into $site"
  "$PY" -m pip install -q --isolated --no-deps --no-index --only-binary=:all: --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$site" "${whl[@]}" >>"$log" 2>&1 \
    || { say "pip install --target $site failed (the end of $log says why)"; tail -5 "$log"; exit 2; }
  export PYTHONPATH="$site:$PYTHONPATH"
  "$PY" - "$site" >>"$log" 2>&1 <<'EOF' || { say "the carried wheels do not import from $site:"; tail -5 "$log"; exit 2; }
"""Import every top-level module the installed wheels provide, from SITE; report requirements unmet."""
import importlib, importlib.metadata as md, pathlib, sys
from packaging.requirements import Requirement

site = pathlib.Path(sys.argv[1]).resolve()
names, bad = set(), []
for dist in md.distributions(path=[str(site)]):
    top = (dist.read_text("top_level.txt") or "").split() or sorted(
        {f.parts[0].removesuffix(".py") for f in dist.files or [] if not f.parts[0].endswith((".dist-info", ".data"))
         and f.parts[0] != "bin"})
    names.update(n for n in top if n.isidentifier())
    for req in dist.requires or []:
        r = Requirement(req)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            found = md.version(r.name)
        except md.PackageNotFoundError:
            found = None
        if found is None or (r.specifier and found not in r.specifier):
            print(f"[gpu_check] note: {dist.metadata['Name']} wants {r}, found {found}")
for name in sorted(names):
    try:
        mod = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - every failure is reported, then the check stops
        bad.append(f"{name}: {type(err).__name__}: {err}")
        continue
    where = pathlib.Path(getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", [""])))).resolve()
    if site not in where.parents:
        bad.append(f"{name} imported from {where}, not from {site}")
for line in bad:
    print(f"[gpu_check] error: {line}")
print(f"[gpu_check] imported {len(names) - len(bad)} of {len(names)} modules from {site}: {', '.join(sorted(names))}")
sys.exit(1 if bad else 0)
EOF
  tail -1 "$log"
fi
"$PY" - >>"$log" 2>&1 <<'EOF' || { say "hybridtrain's dependencies are missing or refused:"; tail -4 "$log"; exit 2; }
import sys
from hybridtrain.versions import require_tested_versions

require_tested_versions()  # exit 2 naming the version to install
import deepspeed, datasets, hydra, safetensors, torch, transformers

cuda = torch.cuda.is_available()
print("[gpu_check] python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda,
      "| GPUs", torch.cuda.device_count(), torch.cuda.get_device_name(0) if cuda else "-",
      "| deepspeed", deepspeed.__version__, "| transformers", transformers.__version__, "from", transformers.__file__)
EOF
tail -1 "$log"
if [ "$install_only" = 1 ]; then say "installed and checked in $(elapsed) s (--install-only)"; exit 0; fi

# 2. the tier but the benchmark, 3. the benchmark alone; the verdict of each test is in $verdicts at once
export HYBRIDTRAIN_TEST_GPU=1 PYTHONUNBUFFERED=1 HYBRIDTRAIN_GPU_VERDICTS="$verdicts" HYBRIDTRAIN_GPU_RESULTS="$dir"
export HYBRIDTRAIN_CACHE=${HYBRIDTRAIN_CACHE:-${TMPDIR:-/tmp}/hybridtrain-gpu-check-cache}
PYTEST=("$PY" -m pytest -q -rA -p no:cacheprovider --timeout-method=signal)
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadgroup) || xdist=(-p no:xdist)
bench_test=${GPU_CHECK_BENCH:-tests/gpu/test_gpu_runs.py::test_single_gpu_mfu_benchmark}
run_part tier $(( BUDGET - ${GPU_CHECK_BENCH_S:-150} - $(elapsed) )) "${PYTEST[@]}" "${xdist[@]}" \
  --timeout "${GPU_CHECK_TEST_TIMEOUT:-240}" "${GPU_CHECK_TESTS:-tests/gpu}" --deselect "$bench_test"
tier=$?
left=$(( BUDGET - $(elapsed) ))
if [ "$left" -gt 60 ]; then
  run_part bench "$left" "${PYTEST[@]}" -p no:xdist --timeout $(( left - 10 )) \
    "$bench_test"
  bench=$?
else
  say "no time left for the benchmark test"; bench=124
fi

# 4. the summary: one row per test from $verdicts (a test that started and has no verdict was stopped)
"$PY" - "$verdicts" "$dir" "$stamp" "$tier" "$bench" "$dry" <<'EOF' | tee "$dir/summary.md"
import glob, json, pathlib, sys

verdicts, out, stamp, tier, bench, dry = sys.argv[1:]
tests = {}  # test -> its verdict records, in the order the tests started
for line in open(verdicts):
    r = json.loads(line)
    tests.setdefault(r["test"], [])
    if r["event"] == "verdict":
        tests[r["test"]].append(r)


def verdict(records: list[dict]) -> tuple[str, str]:
    """(outcome, reason) of one test from its setup/call/teardown verdicts."""
    if not records:
        return "stopped (no verdict: time limit or killed)", ""
    for r in records:
        if r["outcome"] == "failed":
            return ("failed" if r["when"] == "call" else f"error in {r['when']}"), r["reason"]
    skipped = [r for r in records if r["outcome"] == "skipped"]
    return ("skipped", skipped[0]["reason"]) if skipped else ("passed", "")


rows = {t: (*verdict(v), sum(r["seconds"] for r in v)) for t, v in tests.items()}
try:
    import torch
    device = (f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}" if torch.cuda.is_available()
              else "no GPU") + f", torch {torch.__version__} (CUDA {torch.version.cuda})"
except Exception as err:  # noqa: BLE001
    device = f"unknown ({err})"
count = {k: sum(o == k for o, _, _ in rows.values()) for k in ("passed", "failed", "skipped")}
other = len(rows) - sum(count.values())
lines = [f"### GPU check {stamp}{' (dry run, no GPU)' if dry == '1' else ''}", "",
         f"`bash scripts/gpu_check.sh{' --dry-run' if dry == '1' else ''}` on {device}: {count['passed']} passed, "
         f"{count['failed']} failed, {count['skipped']} skipped, {other} stopped or in error; pytest exit codes: tier "
         f"{tier}, benchmark {bench}. Files: `bench/results/{pathlib.Path(out).name}/`.", "",
         "| test | verdict | s | reason |", "|---|---|---|---|"]
for test, (outcome, reason, seconds) in rows.items():
    reason = reason.replace("|", "\\|").replace("\n", " ")[:200]
    lines.append(f"| `{test.split('::')[-1].split('@')[0]}` | {outcome} | {seconds:.0f} | {reason} |")
bench_md = sorted(glob.glob(f"{out}/gpu_mfu_2*.md"))
if bench_md:
    lines += ["", *[ln for ln in open(bench_md[-1]).read().splitlines()[2:] if ln.strip()]]
print("----- paste into docs/gpu.md (section 'GPU check results') -----")
print("\n".join(lines))
print("-----")
EOF
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  mkdir -p "$OUT/$(basename "$dir")" && cp "$dir"/* "$OUT/$(basename "$dir")/" && say "copied to \$OUT/$(basename "$dir")"
fi
say "done in $(elapsed) s: $dir"
# passed: both parts ran to the end (pytest exit 0) and no test is without a verdict; a dry run: every
# test skipped because there is no GPU
"$PY" - "$verdicts" "$tier" "$bench" "$dry" <<'EOF'
import json, sys

verdicts, tier, bench, dry = sys.argv[1:]
final = {}
for line in open(verdicts):
    r = json.loads(line)
    final.setdefault(r["test"], [])
    if r["event"] == "verdict":
        final[r["test"]].append(r)
if not final:
    sys.exit("[gpu_check] no test ran")
if dry == "1":
    wrong = [t for t, v in final.items() if not v or any(r["outcome"] != "skipped" or "needs an NVIDIA GPU" not in r["reason"]
                                                         for r in v)]
    sys.exit(f"[gpu_check] dry run: not skipped for the missing GPU: {wrong}" if wrong else 0)
stopped = [t for t, v in final.items() if not v]
failed = [t for t, v in final.items() if any(r["outcome"] == "failed" for r in v)]
if stopped or failed or tier != "0" or bench != "0":
    sys.exit(f"[gpu_check] FAILED: {len(failed)} failed, {len(stopped)} stopped; exit codes tier {tier}, bench {bench}")
EOF
