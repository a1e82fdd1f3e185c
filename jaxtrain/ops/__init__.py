"""Kernels models call: attention implementations and the chunked output-head loss.

They take and return plain arrays; where a kernel needs per-device shapes it runs inside `shard_map` over the mesh
that `jaxtrain.sharding.constraints.activation_sharding` made active, so models stay mesh-agnostic.
"""
