"""k3's local OpenAI-compatible server (``k3-run --serve``; the optional ``serve`` extra)."""
