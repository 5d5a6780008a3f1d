"""The SLURM launcher: render ``slurm/job.sbatch`` for a plan, write it into the run directory, submit it.

The controller (``python -m hybridtrain``) has already validated the plan against
``launcher.nodes x launcher.gpus_per_node``, prepared the data and written ``config.yaml``,
``plan.json`` and ``data.json``; the job only needs the run directory (on a filesystem the nodes
share). Inside the job, ``srun`` starts ``python -m hybridtrain.worker RUN_DIR`` once per rank and
each rank derives its ``env://`` variables from SLURM's (:mod:`hybridtrain.launch.env`).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from string import Template

from hybridtrain.config.schema import SlurmLauncherConfig
from hybridtrain.launch.devices import cpu_ranks_env
from hybridtrain.launch.placement import crossing
from hybridtrain.plan.types import Plan
from hybridtrain.rundir import RunDir

TEMPLATE = (Path(__file__).resolve().parents[1] / "_slurm" / "job.sbatch").resolve()
"""The job script template: ``slurm/job.sbatch`` of the checkout (``hybridtrain/_slurm`` links to
``slurm/``), or the copy a wheel holds there."""
NEED_CLIENT = ("launcher=slurm needs SLURM's client tools (sbatch, srun, scontrol) on PATH: run this on the "
               "cluster's login node, or install them (Debian/Ubuntu: apt-get install slurm-client); "
               "launcher.submit=false only writes the job script")


class _Template(Template):
    """``@{name}`` placeholders: ``$`` and ``%`` belong to bash and sbatch in the template."""

    delimiter = "@"


def cluster_has_gpus(partition: str | None) -> bool:
    """Whether ``sinfo`` lists GPU GRES in ``partition`` (the default one: all); False without ``sinfo``."""
    if shutil.which("sinfo") is None:
        return False
    cmd = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.returncode == 0 and "gpu" in out.stdout


GPU_CPUS_PER_TASK = 8
"""``--cpus-per-task`` of a GPU job's ranks unless ``launcher.cpus_per_task``/``threads_per_rank`` say
otherwise: GPU nodes have 8 or more cores per GPU (DGX A100: 16, DGX H100: 14), and a rank needs a few
for its data, its CUDA launches and NCCL's threads."""
GPU_MEM_PER_GPU = "64G"
"""``--mem-per-gpu`` of a GPU job unless ``launcher.mem_per_gpu`` says otherwise: a rank's host memory
(data, the unit being initialised, pinned buffers) within what GPU nodes have per GPU (128 GB and more)."""


def _asked(options: list[str], prefix: str) -> bool:
    """Whether one of the ``launcher.sbatch`` options starts with ``prefix`` (``--mem`` matches ``--mem=0``
    and ``--mem-per-cpu``)."""
    return any(o.strip().removeprefix("#SBATCH").strip().startswith(prefix) for o in options)


def resources(launcher: SlurmLauncherConfig, gpus: bool, per_node: int) -> list[str]:
    """The ``#SBATCH`` options of the devices, CPUs and host memory a job of ``per_node`` ranks a node asks
    for. A GPU job always asks for CPUs and memory with its GPUs (a partition's defaults can be one core and
    a few GB per task); the same kind of option in ``launcher.sbatch`` replaces hybridtrain's."""
    out = [f"--gpus-per-node={per_node}"] if gpus else []
    cpus = launcher.cpus_per_task or launcher.threads_per_rank or (GPU_CPUS_PER_TASK if gpus else None)
    if cpus and not _asked(launcher.sbatch, "--cpus-per"):
        out.append(f"--cpus-per-task={cpus}")
    if gpus and not _asked(launcher.sbatch, "--mem"):
        out.append(f"--mem-per-gpu={launcher.mem_per_gpu or GPU_MEM_PER_GPU}")
    return out


def render(run_dir: Path, plan: Plan, launcher: SlurmLauncherConfig, gpus: bool, python: str, workdir: Path) -> str:
    """The job script for ``plan`` (pure: no file, no SLURM call)."""
    per_node = plan.world_size // plan.nodes
    requests = "".join(f"#SBATCH {option}\n" for option in resources(launcher, gpus, per_node))
    for key in ("partition", "account", "qos", "time", "constraint"):
        value = getattr(launcher, key)
        if value:
            requests += f"#SBATCH --{key}={value}\n"
    preempt = ""
    if launcher.signal_seconds:
        preempt += f"#SBATCH --signal=USR1@{launcher.signal_seconds}\n"
    if launcher.requeue:
        preempt += "#SBATCH --requeue\n"
    options = "".join(f"#SBATCH {line.strip().removeprefix('#SBATCH').strip()}\n" for line in launcher.sbatch)
    exports = ""
    if launcher.threads_per_rank:
        exports += f" HYBRIDTRAIN_THREADS={launcher.threads_per_rank}"
    if launcher.master_port:
        exports += f" HYBRIDTRAIN_MASTER_PORT={launcher.master_port}"
    exports += "".join(f" {k}={v}" for k, v in cpu_ranks_env(gpus).items())  # CPU processes: no GPU, on GPU nodes too
    on_stop = ('    echo "[hybridtrain] requeueing job $SLURM_JOB_ID; it resumes from that checkpoint"\n'
               '    scontrol requeue "$SLURM_JOB_ID"\n' if launcher.requeue else "")
    summary = (f"{plan.dims.product()} = {plan.world_size} ranks on {plan.nodes} node(s) x "
               f"{per_node} {'GPU(s)' if gpus else 'CPU process(es)'}")
    files = RunDir(run_dir)
    return _Template(TEMPLATE.read_text()).substitute(
        summary=summary, run_dir_q=shlex.quote(str(run_dir)), config=str(files.config_file),
        log=str(files.slurm_log("%j")), stop_marker=files.stop_marker.name,
        script=shlex.quote(str(files.job_script)), job_name=f"hybridtrain-{run_dir.name}",
        nodes=plan.nodes, tasks_per_node=per_node, resources=requests, workdir=str(workdir),
        preempt=preempt, options=options, python=shlex.quote(python),
        setup="".join(line + "\n" for line in launcher.setup), exports=exports, on_stop=on_stop)


def write(run_dir: Path, plan: Plan, launcher: SlurmLauncherConfig) -> Path:
    """Render the job script into ``RUN_DIR/job.sbatch`` and return its path."""
    gpus = launcher.gpus if launcher.gpus is not None else (
        launcher.gpu_type is not None or cluster_has_gpus(launcher.partition))
    text = render(run_dir, plan, launcher, gpus, launcher.python or sys.executable, Path.cwd())
    path = RunDir(run_dir).job_script
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit(run_dir: Path, plan: Plan, launcher: SlurmLauncherConfig) -> int:
    """Write the job script, then (``launcher.submit``) ``sbatch`` it and (``launcher.wait``) wait for it.

    Returns the exit code for the command line: 0 once submitted (or written), the job's exit code
    when waiting, 1 when ``sbatch`` is missing or SLURM rejects the job.
    """
    path = write(run_dir, plan, launcher)
    cross = crossing(plan)
    print(f"[hybridtrain] placement {plan.nodes} node(s) x {plan.world_size // plan.nodes} rank(s); groups crossing "
          f"nodes: {', '.join(cross) if cross else 'none'}", flush=True)
    print(f"[hybridtrain] job script {path}", flush=True)
    if not launcher.submit:
        print(path.read_text(), flush=True)
        print(f"[hybridtrain] not submitted (launcher.submit=false); the job prepares the data when it starts; "
              f"submit with: sbatch {shlex.quote(str(path))}", flush=True)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"[hybridtrain] error: sbatch not found. {NEED_CLIENT}", file=sys.stderr)
        return 1
    cmd = [sbatch, "--parsable"] + (["--wait"] if launcher.wait else []) + [str(path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip().split(";")[0]  # --parsable: "ID" or "ID;cluster", before waiting
    if not job_id:
        _, err = proc.communicate()
        print(f"[hybridtrain] error: SLURM rejected the job (sbatch exit code {proc.returncode}): {err.strip()}\n"
              f"[hybridtrain] job script {path}; fix the launcher keys it came from (launcher.partition, "
              "launcher.account, launcher.qos, launcher.time, launcher.constraint, launcher.sbatch)", file=sys.stderr)
        return 1
    from hybridtrain.launch.lock import record_job

    record_job(RunDir(run_dir).lock_file, job_id)  # the folder stays the job's while SLURM lists it
    log = RunDir(run_dir).slurm_log(job_id)
    print(f"[hybridtrain] submitted job {job_id}; log {log}; metrics {RunDir(run_dir).metrics_file}", flush=True)
    if not launcher.wait:
        proc.wait()
        return 0
    try:
        _, err = proc.communicate()
    except KeyboardInterrupt:
        print(f"\n[hybridtrain] stopped waiting; job {job_id} keeps running (scancel {job_id} ends it)", file=sys.stderr)
        return 130
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.is_file() else "(no log)"
        print(f"[hybridtrain] job {job_id} failed with exit code {proc.returncode}{': ' + err.strip() if err.strip() else ''}"
              f"\n[hybridtrain] log {log}; its end:\n{tail}", file=sys.stderr)
        return proc.returncode
    print(f"[hybridtrain] job {job_id} completed; log {log}", flush=True)
    return 0
