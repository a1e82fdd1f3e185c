"""Placement: a model (name + config) on a mesh with its sharding rules, split for functional use, and the shardings
of the state kept with it. Training, generation, Hugging Face import/export, the planner and the engines all place
models through `place_model`."""
