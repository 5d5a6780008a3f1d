"""Benchmark-only injection (``bench/run.py`` puts this folder first on the workers' PYTHONPATH).

``HT_BENCH_NO_ALLREDUCE=1``: ``torch.distributed.all_reduce`` returns at once without
communicating. The tensor-parallel layers (DeepSpeed's ``ColumnParallel`` / ``RowParallel``, the
vocabulary-parallel loss) and the gradient-norm reduction all call it, so a run with it measures
the same shapes and kernels minus the all-reduces: the tensor-parallel cost comparison uses it
to split a tp=2 step into compute and communication. The losses of such a run are wrong by design;
only its step times are used. Other collectives (barriers, broadcasts) still run.

It patches every process that starts with this folder on its path, the controller included: local
CPU ranks are forked from the controller (``hybridtrain.launch.preload``) and never run a
``sitecustomize`` of their own, so the patch has to be in the process they are forked from.

``HT_BENCH_A2A_DIR=DIR``: every ``torch.distributed.all_to_all_single`` (the expert-parallel dispatch's
exchanges) is timed, one line per call in ``DIR/rank<R>.txt`` (``bench/a2a_timer.py``, used by
``bench/bench_moe.py``). The run itself is unchanged.
"""
import os

if os.environ.get("HT_BENCH_NO_ALLREDUCE") == "1":
    import torch.distributed as _dist

    class _Done:
        def wait(self, *args, **kwargs):
            return True

        def is_completed(self):
            return True

    def _no_all_reduce(tensor, op=None, group=None, async_op=False):
        return _Done() if async_op else None

    _dist.all_reduce = _no_all_reduce

if os.environ.get("HT_BENCH_A2A_DIR"):
    from bench.a2a_timer import install as _install_a2a_timer

    _install_a2a_timer(os.environ["HT_BENCH_A2A_DIR"])
