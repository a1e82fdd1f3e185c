"""The AlphaZero application's own pieces, beside its entry point `scripts/alphazero.py`: self-play, matches and search
on a pgx game (`selfplay`), and the replay buffer that the learner's train step reads as its dataset (`replay`). They
use jaxtrain through its public API only; the network is the registered model `alphazero` (models/alphazero.py)."""
