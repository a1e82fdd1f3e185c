"""Reinforcement learning, AlphaZero-style: self-play with search (`selfplay`), a replay buffer that the framework's
sharded train step reads as a dataset (`replay`). `scripts/alphazero.py` puts them together with a learner."""
