"""Tensor-parallel layers and process-group handles."""
