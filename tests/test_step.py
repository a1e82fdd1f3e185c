"""The pure train step: a non-finite loss or gradient skips the update and says so in the metrics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain.parallel.step import train_step

PARAMS = {"w": jnp.ones((3,)), "b": jnp.zeros(())}


def quadratic(params, batch):
    return jnp.sum((params["w"] * batch["x"] + params["b"]) ** 2), {}


def poisoned(grad_fn):
    def wrapped(params, batch):
        (loss, metrics), grads = grad_fn(params, batch)
        return (loss, metrics), {**grads, "w": grads["w"].at[0].set(jnp.nan)}

    return wrapped


def step_with(grad_fn):
    optimizer = optax.adam(0.1)
    state = {"params": PARAMS, "opt_state": optimizer.init(PARAMS), "step": jnp.zeros((), jnp.int32)}
    step = jax.jit(
        functools.partial(train_step, grad_fn=grad_fn, optimizer=optimizer, schedule=optax.constant_schedule(0.1))
    )
    return state, step(state, {"x": jnp.arange(3.0)})


def test_finite_step_updates():
    before, (after, metrics) = step_with(jax.value_and_grad(quadratic, has_aux=True))
    assert int(metrics["nonfinite"]) == 0 and int(after["step"]) == 1
    assert not np.allclose(after["params"]["w"], before["params"]["w"])


def test_nonfinite_gradient_skips_the_update_and_is_reported():
    before, (after, metrics) = step_with(poisoned(jax.value_and_grad(quadratic, has_aux=True)))
    assert int(metrics["nonfinite"]) == 1 and int(after["step"]) == 1  # the data position moves on
    for got, want in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"])):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(got, want)
