"""Multimodal inputs: parsing, media loading, hashing, HF processing with prompt updates."""
