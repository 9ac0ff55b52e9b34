"""Elastic training: checkpoints (durable, atomic, safetensors), later the adaptive policy and
recovery decisions (DESIGN.md §3, rank 5)."""
