"""Shared model layers: parallel linears, embeddings, norms, rotary, activations, MoE, sampler.

Tensor parallelism lives here (never in model files): each layer shards its own parameters and
carries a shard-aware ``weight_loader`` so checkpoints load by name.
"""
