"""Evaluation and sizing: KV formats on real models, retrieval, capacity (see docs/EVALUATION.md)."""
