"""Checkpoints: atomic saves, exact resume, and HF-named weights for export."""
