"""jaxtrain: declarative distributed training for JAX. See README.md; the run reads top to bottom in run.py."""
