"""HF model adapters, seeded sharded construction and pipeline layers."""
