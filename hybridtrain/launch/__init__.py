"""Starting the workers: ``local`` (this machine), ``slurm`` (an sbatch job), ``multinode`` (the
deepspeed runner over several machines)."""
