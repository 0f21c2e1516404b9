"""I/O layer: config, safetensors shards, checkpoint index, tokenizer. Never imports model."""
