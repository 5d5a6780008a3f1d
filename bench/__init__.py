"""hybridtrain's benchmarks against their baselines (``bench/README.md``); run from the repository
root as modules, e.g. ``python -m bench.run --quick``, so that this checkout's ``hybridtrain`` is
the one imported."""
