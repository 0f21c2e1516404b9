"""Streaming: aligned reads, the trunk ring, the expert cache, budgets. Never does math."""
