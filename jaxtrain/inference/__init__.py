"""Text generation from a trained model: a KV cache laid out by the sharding rules, prefill, then one token a step."""
