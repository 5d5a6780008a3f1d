"""What the tests share: composing configs (:mod:`helpers.config`), running the command line
(:mod:`helpers.launch`), tiny checkpoints (:mod:`helpers.families`, :mod:`helpers.finetune`), small corpora
(:mod:`helpers.data`), the spawned layer tests' checks (:mod:`helpers.tp_checks`) and the bf16 probe
script (:mod:`helpers.accum_probe`). ``tests/`` is on ``sys.path`` (``tests/conftest.py``), so tests
import ``from helpers.launch import run_cli``."""
