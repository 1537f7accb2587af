import jax
import jax.numpy as jnp
import numpy as np
import pytest

import inshrink_jax as ij


def test_ema_weights_the_newest_gradient_by_decay():
    sens = ij.GradientEMA(every=10, window=3)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,), jnp.bfloat16)}
    ema = sens.init(params)
    assert all(x.dtype == jnp.float32 and float(jnp.abs(x).sum()) == 0 for x in jax.tree.leaves(ema))
    expected = np.zeros((4, 3), np.float32)
    for t in (1.0, 2.0, 4.0):
        ema = sens.update(ema, jax.tree.map(lambda p: jnp.full(p.shape, t, p.dtype), params))
        expected = np.float32(0.9) * np.float32(t) + np.float32(0.1) * expected
    np.testing.assert_allclose(np.asarray(ema["w"]), expected, rtol=1e-6)
    assert ema["b"].shape == (3,)


def test_active_is_the_window_before_each_checkpoint():
    sens = ij.GradientEMA(every=10, window=3)
    assert [s for s in range(1, 31) if sens.active(s)] == [8, 9, 10, 18, 19, 20, 28, 29, 30]
    assert all(ij.GradientEMA(every=5, window=50).active(s) for s in range(20))


def test_update_traces_into_a_jitted_train_step_and_keeps_the_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    params = {"w": jax.device_put(jnp.ones((8, 8)), sharding)}
    sens = ij.GradientEMA(every=4)
    ema = sens.init(params)
    assert ema["w"].sharding == sharding

    @jax.jit
    def step(params, ema):
        grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
        return sens.update(ema, grads)

    ema = step(params, ema)
    np.testing.assert_allclose(np.asarray(ema["w"]), 0.9 * 2.0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="every"):
        ij.GradientEMA(every=0)
    with pytest.raises(ValueError, match="decay"):
        ij.GradientEMA(every=5, decay=1.5)
