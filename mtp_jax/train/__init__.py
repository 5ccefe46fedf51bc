"""Training: ``python -m mtp_jax.train_mtp`` (the MTP head by self-distillation; docs/train.md),
and the tools that made the trained fixtures and the default model (targets, synthetic data)."""
