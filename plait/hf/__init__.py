"""Hugging Face support: reading a class's config and structure, running it as transformers wrote it,
its checkpoints in and out, and its data."""
