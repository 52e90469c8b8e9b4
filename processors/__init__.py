"""Multimodal processors, one module per model family (registered with their models)."""
