"""Leaf policies by structure (policy.py): optax state types, NNX variable types, Linen collections, user rules
and labels; and through the handler, what each decision stores and restores."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import inshrink_jax as ij
from inshrink_jax import policy, save


def kinds(state, labels=None, **cfg):
    """Key path -> (kind, method) of each leaf as a save would store it."""
    plan = save.plan(state, None, labels, ij.CompressionConfig(**cfg))
    return {r.keystr: (r.kind, r.method) for r in plan.records}


def vae_params():
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return {"encoder": {"mu": {"kernel": w(64, 32)}, "nu": {"kernel": w(64, 32)}},
            "trace": {"kernel": w(32, 64)}, "momentum": {"kernel": w(32, 64)}}


@pytest.mark.slow  # 21 s; .ci/run runs it
def test_parameters_under_modules_named_like_moments_are_parameters(tmp_path):
    params = vae_params()
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    k = kinds(state, optimizer="drop")
    for name in ("['encoder']['mu']", "['encoder']['nu']", "['trace']", "['momentum']"):
        assert k[f"['params']{name}['kernel']"] == ("quantized", "weights")
        assert k[f"['opt_state'][0].mu{name}['kernel']"] == ("dropped", None)  # the real moments: dropped
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False)))
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    r = mngr.restore(0)
    mu = np.asarray(r["params"]["encoder"]["mu"]["kernel"])
    original = np.asarray(params["encoder"]["mu"]["kernel"])
    assert np.count_nonzero(mu) > 0.9 * mu.size
    assert np.corrcoef(mu.ravel(), original.ravel())[0, 1] > 0.99


@pytest.mark.parametrize("key", ["opt_state", "optimizer_stuff", "x"])
def test_amsgrad_nu_max_is_a_moment_under_any_key(key):
    params = vae_params()
    state = {"params": params, key: optax.chain(optax.clip(1.0), optax.amsgrad(1e-3)).init(params)}
    k = kinds(state, optimizer="quantize")
    nu_max = {p: v for p, v in k.items() if ".nu_max" in p}
    assert len(nu_max) == 4 and set(nu_max.values()) == {("quantized", "moments")}
    pols = policy.classify(state, ij.CompressionConfig())
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    roles = {jax.tree_util.keystr(p): pol.moment for (p, _), pol in zip(flat, pols)}
    assert {roles[p] for p in nu_max} == {policy.SECOND}
    assert {v for p, v in roles.items() if ".mu[" in p} == {policy.FIRST}


def test_batch_statistics_are_lossless_whatever_their_shape():
    rng = np.random.default_rng(0)
    state = {"params": {"w": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)},
             "batch_stats": {"bn": {"mean": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)}}}
    k = kinds(state)
    assert k["['batch_stats']['bn']['mean']"] == ("array", None)
    assert k["['params']['w']"] == ("quantized", "weights")


class Model(nnx.Module):
    def __init__(self, rngs):
        self.mu = nnx.Linear(64, 64, rngs=rngs)
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.stats = nnx.BatchStat(jnp.ones((64, 64)))


def test_nnx_variable_types_decide():
    model = Model(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.amsgrad(1e-3), wrt=nnx.Param)
    k = kinds({"model": nnx.state(model), "opt": nnx.state(opt)}, optimizer="quantize")
    assert k["['model']['mu']['kernel'].value"] == ("quantized", "weights")
    assert k["['model']['stats'].value"] == ("array", None)  # a 2-D BatchStat
    assert k["['opt']['opt_state'][0]['nu_max']['mu']['kernel'].value"] == ("quantized", "moments")
    assert k["['opt']['opt_state'][0]['mu']['mu']['kernel'].value"] == ("quantized", "moments")
    assert k["['opt']['opt_state'][0]['count'].value"] == ("array", None)


def budgets(state):
    """Key path -> the budget factor of each first moment a save would code."""
    plan = save.plan(state, None, None, ij.CompressionConfig())
    return {plan.records[i].keystr: b for i, b, first in zip(plan.moments, plan.budgets, plan.first) if first}


def test_lions_first_moment_takes_the_normalized_budget_wherever_its_state_is_found():
    """Lion's `mu` (its update a sign) is coded within `NORMALIZED_BUDGET` of the first-moment budget; Adam's `mu` and
    SGD's `trace` within all of it: as an optax state, as the plain dict a restore without a target gives, and
    as NNX's mirror of the state."""
    params = vae_params()
    lion = {"params": params, "opt_state": optax.lion(1e-4).init(params)}
    chained = {"params": params, "opt_state": optax.chain(optax.clip(1.0), optax.lion(1e-4)).init(params),
               "other": optax.sgd(0.1, momentum=0.9).init(params), "adam": optax.adam(1e-3).init(params)}
    plain = {"params": params, "opt_state": [{"count": jnp.int32(3), "mu": params}]}
    model = Model(nnx.Rngs(0))
    nnx_lion = {"model": nnx.state(model), "opt": nnx.state(nnx.Optimizer(model, optax.lion(1e-4), wrt=nnx.Param))}
    for state, n in ((lion, 4), (chained, 12), (plain, 4), (nnx_lion, 4)):
        b = budgets(state)
        assert len(b) == n
        for key, factor in b.items():
            lion_mu = re.match(r"\['opt(_state)?'\](\['opt_state'\])?(\[\d+\])*(\.mu|\['mu'\])", key) is not None
            assert factor == (policy.NORMALIZED_BUDGET if lion_mu else 1.0), key


def test_muon_and_schedule_free_states_hold_moments():
    """Muon's `mu` (optax.contrib) is a first moment at the normalized budget; the second moment schedule-free
    AdamW's RMS state holds is a second moment, and its `z` (an iterate) is quantized as parameters are, unless
    a rule says otherwise."""
    params = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,))}
    b = budgets({"opt_state": optax.contrib.muon(1e-3).init(params)})
    assert b == {"['opt_state'].inner_states['muon'].inner_state[0].mu['w']": policy.NORMALIZED_BUDGET,
                 "['opt_state'].inner_states['adam'].inner_state[0].mu['b']": 1.0}  # Muon's Adam for the rest
    k = kinds({"params": params, "opt_state": optax.contrib.schedule_free_adamw(1e-3).init(params)})
    assert k["['opt_state'].base_optimizer_state[0].nu['w']"] == ("quantized", "moments")
    assert k["['opt_state'].z['w']"] == ("quantized", "weights")
    assert k["['opt_state'].z['b']"] == ("array", None)  # 1-D: stored exactly, as a parameter's bias is
    k = kinds({"params": params, "opt_state": optax.contrib.schedule_free_adamw(1e-3).init(params)},
              policy_rules=((r"\.z\[", "lossless"),))
    assert k["['opt_state'].z['w']"] == ("array", None)


def test_a_restored_plain_tree_keeps_its_moments():
    """A restore without a target returns dicts; an optax state in it is known by its field set."""
    params = vae_params()
    plain = {"params": params, "opt_state": [{"count": jnp.int32(3), **{f: params for f in ("mu", "nu")}}, {}]}
    k = kinds(plain, optimizer="drop")
    assert k["['opt_state'][0]['nu']['encoder']['mu']['kernel']"] == ("dropped", None)
    assert k["['opt_state'][0]['count']"] == ("dropped", None)  # reset with the dropped second moment
    assert kinds({"params": {"trace": params["trace"]}})["['params']['trace']['kernel']"] == ("quantized", "weights")


def test_a_policy_rule_that_matches_nothing_is_an_error():
    state = {"params": vae_params()}
    with pytest.raises(ValueError, match=r"policy_rules \[\('opt_state', 'drop'\)\] match no array leaf"):
        kinds(state, policy_rules=(("opt_state", "drop"),))


def test_labels_override_by_function_and_by_tree():
    params = vae_params()
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    k = kinds(state, labels=lambda path, x: "lossless" if jax.tree_util.keystr(path).startswith("['params']['enc")
              else None)
    assert k["['params']['encoder']['mu']['kernel']"] == ("array", None)
    assert k["['params']['trace']['kernel']"] == ("quantized", "weights")
    k = kinds(state, labels={"params": {"encoder": "lossless", "trace": None, "momentum": None}, "opt_state": None})
    assert k["['params']['encoder']['nu']['kernel']"] == ("array", None)
    assert k["['params']['momentum']['kernel']"] == ("quantized", "weights")
    with pytest.raises(ValueError, match="labels no leaf"):
        kinds(state, labels={"params": None, "opt_state": None})
    with pytest.raises(ValueError, match="structure of the saved state"):
        kinds(state, labels={"other": "lossless"})
    with pytest.raises(ValueError, match="is labelled 'zero'"):
        kinds(state, labels=lambda path, x: "zero")


def save_and_restore(tmp_path, state, **cfg):
    mngr = ocp.CheckpointManager(tmp_path, item_handlers=ij.InshrinkCheckpointHandler(ij.CompressionConfig(
        search=False, **cfg)))
    mngr.save(0, args=ij.InshrinkSave(state))
    mngr.wait_until_finished()
    return mngr.restore(0)


def test_through_the_handler_nu_max_is_dropped_and_batch_statistics_are_exact(tmp_path):
    params = vae_params()
    stats = jnp.asarray(np.random.default_rng(1).normal(size=(64, 64)), jnp.float32)
    state = {"params": params, "batch_stats": {"bn": {"var": stats}},
             "amsgrad": optax.amsgrad(1e-3).init(jax.tree.map(lambda x: x + 1.0, params))}
    r = save_and_restore(tmp_path, state)  # default optimizer policy: drop
    assert not np.any(np.asarray(r["amsgrad"][0]["nu_max"]["trace"]["kernel"]))
    np.testing.assert_array_equal(np.asarray(r["batch_stats"]["bn"]["var"]), np.asarray(stats))


def test_through_the_handler_an_unmatched_rule_refuses_the_save(tmp_path):
    with pytest.raises(ValueError, match="match no array leaf"):
        save_and_restore(tmp_path, {"params": vae_params()}, policy_rules=((r"\.nu\b", "quantize"),))
    assert not any(p.name.isdigit() for p in tmp_path.iterdir())
