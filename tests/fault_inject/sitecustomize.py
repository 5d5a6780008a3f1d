"""Fault injection for tests/dist/test_faults.py, loaded by every Python process whose PYTHONPATH
starts with this folder (``sitecustomize`` is imported at interpreter start-up).

It does nothing unless ``HT_FAULT_RANK`` names this process's ``RANK`` (set by the launcher for each
worker), or the process has no ``RANK`` yet: the process that forks the CPU ranks
(``hybridtrain.launch.preload``), whose children take their ``RANK`` after the fork, so the wrapper
below checks ``RANK`` when it is called. That process is usually forked from the controller (which
also has no ``RANK``): a thread does not survive a fork, so every forked child starts the watcher
again, which leaves a class it already wrapped alone. Then, once DeepSpeed's pipeline engine module is imported, it wraps
``PipelineEngine._exec_backward_pass`` (called once per micro-batch of a step, through the
class's ``_INSTRUCTION_MAP``) so that:

- ``HT_FAULT=kill``: at backward pass number ``HT_FAULT_AT`` (counted from 1 over the run), the
  rank writes ``time.time()`` to ``HT_FAULT_STAMP`` and SIGKILLs itself: a death in the middle
  of a step, between two micro-batches.
- ``HT_FAULT=stall``: at that backward pass the rank sleeps forever (``_ht_injected_stall``),
  a hang that is not a crash and not a collective timeout.
- ``HT_FAULT=fill``: instead, ``DeepSpeedEngine.save_checkpoint`` is wrapped: at the save of step
  ``HT_FAULT_AT`` (the ``hybridtrain`` client state's step) the rank first fills the checkpoint's file
  system with a file inside the checkpoint folder being written, up to the last byte, as another
  process filling the disk would; DeepSpeed's own write then meets the full disk (a real ENOSPC).
- ``HT_FAULT=pause``: the same save of step ``HT_FAULT_AT`` first writes ``time.time()`` to
  ``HT_FAULT_STAMP`` and sleeps ``HT_FAULT_PAUSE`` seconds: a save caught in the middle (its
  ``.tmp-step_N`` folder exists, DeepSpeed's files are not written yet), for a signal sent meanwhile.

The production code has no test hooks; this patches DeepSpeed's class from outside.
"""
import os

if os.environ.get("HT_FAULT") and os.environ.get("RANK", os.environ.get("HT_FAULT_RANK")) == os.environ.get("HT_FAULT_RANK"):
    import signal
    import sys
    import threading
    import time

    def _ht_injected_stall():
        while True:
            time.sleep(3600)

    def _ht_patch():
        while True:  # wait for DeepSpeed's pipeline engine class to exist, then wrap it
            mod = sys.modules.get("deepspeed.runtime.pipe.engine")
            cls = getattr(mod, "PipelineEngine", None) if mod is not None else None
            if cls is not None and hasattr(cls, "_INSTRUCTION_MAP"):
                break
            time.sleep(0.02)
        if getattr(cls, "_ht_wrapped", False):  # wrapped before this process was forked
            return
        if os.environ["HT_FAULT"] in ("fill", "pause"):
            return _ht_patch_save()
        original = cls._exec_backward_pass
        at, calls = int(os.environ["HT_FAULT_AT"]), [0]

        def backward(self, *args, **kwargs):
            if os.environ.get("RANK") != os.environ["HT_FAULT_RANK"]:  # another rank forked from the same process
                return original(self, *args, **kwargs)
            calls[0] += 1
            if calls[0] == at:
                if os.environ["HT_FAULT"] == "kill":
                    with open(os.environ["HT_FAULT_STAMP"], "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                _ht_injected_stall()
            return original(self, *args, **kwargs)

        cls._exec_backward_pass = backward
        cls._ht_wrapped = True
        # the engine dispatches through this class-level table of the original functions
        cls._INSTRUCTION_MAP = {k: (backward if v is original else v) for k, v in cls._INSTRUCTION_MAP.items()}

    def _ht_patch_save():
        import deepspeed.runtime.engine as ds_engine

        cls = ds_engine.DeepSpeedEngine
        if getattr(cls, "_ht_wrapped_save", False):
            return
        original = cls.save_checkpoint

        def save_checkpoint(self, save_dir, *args, **kwargs):
            step = (kwargs.get("client_state") or {}).get("hybridtrain", {}).get("step")
            hit = os.environ.get("RANK") == os.environ["HT_FAULT_RANK"] and step == int(os.environ["HT_FAULT_AT"])
            if hit and os.environ["HT_FAULT"] == "pause":
                with open(os.environ["HT_FAULT_STAMP"], "w") as f:
                    f.write(repr(time.time()))
                time.sleep(float(os.environ["HT_FAULT_PAUSE"]))
            elif hit:
                chunk = b"\0" * (1 << 20)
                with open(os.path.join(save_dir, "ht_filler"), "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(chunk)
                    except OSError:  # ENOSPC: the last MiB did not fit; fill the rest byte by byte
                        try:
                            while True:
                                f.write(b"\0" * 4096)
                        except OSError:
                            pass
            return original(self, save_dir, *args, **kwargs)

        cls.save_checkpoint = save_checkpoint
        cls._ht_wrapped_save = True

    def _ht_watch():
        threading.Thread(target=_ht_patch, name="ht-fault-inject", daemon=True).start()

    _ht_watch()
    os.register_at_fork(after_in_child=_ht_watch)
