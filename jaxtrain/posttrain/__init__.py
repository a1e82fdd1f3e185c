"""Post-training: what trains a model after pre-training, built on the training step and placement. Today:
low-rank adapters on the weight matmuls (`jaxtrain.posttrain.adapters`, docs/post-training.md)."""
