"""Synthetic K3 checkpoints: presets, weights and tokenizer files."""
