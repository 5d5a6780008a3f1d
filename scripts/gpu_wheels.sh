#!/usr/bin/env bash
# The wheels that scripts/gpu_check.sh installs on the lent GPU machine, which reaches no package index.
#   bash scripts/gpu_wheels.sh [DIR]    # on a machine that reaches PyPI; DIR defaults to .gpu_wheels (git-ignored)
# The GPU machine's image has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, peft, pyarrow, pytest,
# pytest-xdist, pytest-timeout and the packages of IMAGE below, and lacks what hybridtrain needs besides:
# deepspeed, hydra-core, omegaconf, antlr4-python3-runtime, datasets, dill, multiprocess, hjson, pydantic
# (pydantic-core, annotated-types, typing-inspection); and its transformers is older than hybridtrain
# accepts (hybridtrain/versions.py). This script downloads exactly those, for CPython 3.12 on x86-64:
# pure-Python wheels, manylinux ones where a package has compiled parts (pydantic-core), and wheels it
# builds here from the sdists PyPI alone publishes (deepspeed, built with DS_BUILD_OPS=0: no compiled ops;
# antlr4-python3-runtime). wandb (the `loggers` extra) is not carried: no GPU test logs to it.
# It then checks the folder: wheels only, one version of each, the tags of that machine, deepspeed pure
# Python, every requirement either in the folder or in the image, an install for Python 3.12 x86-64 with
# pip's --target, and the working tree plus the folder under the device tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dir=${1:-.gpu_wheels}

# deepspeed's and transformers' pins are hybridtrain's tested versions (hybridtrain/versions.py TESTED)
read -r ds_version tf_version < <("$PY" - <<'EOF'
import importlib.util
spec = importlib.util.spec_from_file_location("versions", "hybridtrain/versions.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(mod.TESTED["deepspeed"][0], mod.TESTED["transformers"][0])
EOF
)
# the versions CI runs (keep in step with the CI environment); each a wheel on PyPI
BINARY=("transformers==$tf_version" hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1
        multiprocess==0.70.19 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2)
BUILT=("deepspeed==$ds_version" antlr4-python3-runtime==4.9.3)  # sdists only on PyPI: wheels built here
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
TARGET=(--python-version 3.12 --implementation cp --abi cp312 "${PLATFORMS[@]}")

echo "[gpu_wheels] into $dir: ${BINARY[*]} ${BUILT[*]}"
rm -rf "$dir"
mkdir -p "$dir"
"$PY" -m pip download -q --no-cache-dir --no-deps --only-binary=:all: "${TARGET[@]}" -d "$dir" "${BINARY[@]}"
# no build isolation would bake this machine's torch into deepspeed's build info; isolated, it records none
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps -w "$dir" "${BUILT[@]}"
rm -f "$dir"/*.tar.gz "$dir"/*.zip

"$PY" - "$dir" <<'EOF'
"""Check the folder: see the header of scripts/gpu_wheels.sh."""
import pathlib, re, subprocess, sys, tempfile, zipfile
from email.parser import Parser

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

folder = pathlib.Path(sys.argv[1])
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
"""The GPU machine's image (the device tool's KINDS.md, 'Python packages already there', 2026-11-17)."""
image = {canonicalize_name(n) for n in IMAGE.split()}
REPLACED = {"transformers"}  # in the image, but 5.17: hybridtrain needs its tested release (versions.py)
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                               "platform_machine": "x86_64", "platform_system": "Linux",
                               "implementation_name": "cpython", "os_name": "posix", "extra": ""}
problems, names, requires = [], {}, {}
files = sorted(folder.iterdir())
for f in files:
    if f.suffix != ".whl":
        problems.append(f"{f.name}: not a wheel (the check builds nothing)")
        continue
    name, version, _, tags = parse_wheel_filename(f.name)
    if name in names:
        problems.append(f"two versions of {name}: {names[name]} and {version}")
    names[name] = version
    if not any(t.interpreter in ("py3", "py312", "cp312") and t.abi in ("none", "cp312")
               and (t.platform == "any" or re.fullmatch(r"manylinux(_2_\d+|2014|1)_x86_64", t.platform))
               for t in tags):
        problems.append(f"{f.name}: not for CPython 3.12 on x86-64 ({', '.join(map(str, tags))})")
    with zipfile.ZipFile(f) as z:
        compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd")) or ".so." in n]
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    if compiled and all(t.platform == "any" for t in tags):
        problems.append(f"{f.name}: tagged pure Python but holds compiled files ({compiled[:3]})")
    if name == "deepspeed" and compiled:
        problems.append(f"{f.name}: deepspeed must be built without its ops (DS_BUILD_OPS=0); it holds {compiled[:3]}")
    requires[name] = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    if name in image and name not in REPLACED:
        problems.append(f"{name}: the image already has it; carry only what it lacks")
for name, reqs in requires.items():
    for req in reqs:
        dep = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra or another platform's
        if dep in names:
            if names[dep] not in req.specifier:
                problems.append(f"{name} needs {req}, the folder has {dep} {names[dep]}")
        elif dep not in image:
            problems.append(f"{name} needs {req}: neither in the folder nor in the image")
size = sum(f.stat().st_size for f in files)
tree = sum(pathlib.Path(p).stat().st_size for p in subprocess.run(
    ["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, text=True, check=True).stdout.split("\0")
    if p and pathlib.Path(p).is_file())
if size + tree > 64 * 2**20:
    problems.append(f"the folder ({size / 2**20:.1f} MiB) and the working tree ({tree / 2**20:.1f} MiB) exceed "
                    "the 64 MiB the device tool carries")
with tempfile.TemporaryDirectory() as tmp:  # installs as gpu_check.sh does, for the GPU machine's Python
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--isolated", "--no-deps", "--no-index",
                           "--only-binary=:all:", "--no-compile", "--target", tmp, "--python-version", "3.12",
                           "--implementation", "cp", "--abi", "cp312", "--platform", "manylinux_2_28_x86_64",
                           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                           *map(str, files)], capture_output=True, text=True)
    if proc.returncode:
        problems.append(f"pip install --target for Python 3.12 x86-64 failed: {proc.stderr.strip()[-800:]}")
for line in problems:
    print(f"[gpu_wheels] error: {line}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"[gpu_wheels] ok: {len(files)} wheels, {size / 2**20:.1f} MiB (+ working tree {tree / 2**20:.1f} MiB "
      f"of 64): {', '.join(f'{n} {v}' for n, v in sorted(names.items()))}")
EOF
echo "[gpu_wheels] carry it: the device tool's run with carry=[\"$dir\"] and command \"bash scripts/gpu_check.sh\""
