"""hybridtrain: train HuggingFace causal LMs with data x tensor x pipeline parallelism.

Entry points: ``python -m hybridtrain`` (train) and :mod:`hybridtrain.worker` (one rank).
Importing this package imports neither torch nor deepspeed.
"""

__version__ = "0.1.0"
