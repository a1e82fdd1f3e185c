"""Asynchronous parameter-server training on Ray (`jaxtrain train --engine ray`).

    driver (engine.py)      hands out batches, routes each gradient to the server shards, checkpoints, restarts
    workers (worker.py)     W JAX processes, each on its own mesh: params -> gradient of one batch, at its own pace
    server shards (server.py)  S processes, each holding a part of the params and its optimizer state
    dispatch.py             who computes which batch on which params, bounded staleness, the batch log (no Ray)
    shards.py               which leaves each server shard holds (no Ray)
    watchdog.py             a local Ray session's processes die with the driver, kill -9 included

Gradients move from a worker to the servers, and params from the servers to a worker, through Ray's object store;
the driver passes only references. Every update goes through the same update core as the SPMD step
(`jaxtrain.parallel.step.apply_update`) with the same optimizer (`jaxtrain.training.optim`); checkpoints use the same
Orbax `Checkpoints`, directory lock and run identity as `jaxtrain.training.loop`.
"""
