"""Training frameworks running autoshard: ``hf`` (transformers' Trainer), ``lightning``
(Lightning Trainer and Fabric), ``torchtitan`` (a ``parallelize_fn``, named by its ``--module``).
Each module imports its framework when it is imported itself, so ``import autoshard`` never
needs them; see docs/integrations.md."""
