"""Synthetic K3 checkpoints and their DSpark drafts: presets, weights and tokenizer files."""
