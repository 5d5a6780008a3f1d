"""Training data: sources -> formats -> tokenized once and cached (``prepare``) -> memory-mapped,
plan-independent sample order (``sampler``). See ``docs/data.md``."""
