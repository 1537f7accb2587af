"""What each leaf of a saved state is, and how it is stored: decided by structure, never by substrings of names.

Every leaf gets a `LeafPolicy`: its part of the state (model parameters, optimizer state, everything else), its
role inside the optimizer (a first or second moment, or the step counter its bias correction uses), and its
policy ("quantize", "lossless" or "drop"). The structure that decides it:

- **optax states**: a leaf under a field of an optax state NamedTuple is optimizer state; the field's role comes
  from `MOMENT_FIELDS` (e.g. `ScaleByAdamState.mu` is a first moment, `ScaleByAmsgradState.nu_max` a second
  one). A field of `ITERATE_FIELDS` (schedule-free's `z`, an iterate of the parameters) is quantized as
  parameters are. Any other leaf inside an optax state (a schedule's `count`, `inject_hyperparams`' values) is
  optimizer state stored losslessly.
- **NNX**: a leaf of an `nnx.Param` is a parameter; of an optimizer variable (`nnx.optimizer.OptState`: what
  `nnx.state(nnx.Optimizer(...))` holds) optimizer state, whose role is the field of the optax state it mirrors
  (the first field name on its path inside the optimizer state); of any other variable (`nnx.BatchStat`,
  RNG state, caches) other state, lossless.
- **Linen collections**: leaves under a `batch_stats` collection are other state, lossless.
- **Plain trees** (what a restore without a target returns): a dict whose keys are exactly the fields of one of
  the optax states with a step counter (e.g. {count, mu, nu}) is read as that state.
- Everything else: a float leaf is a model parameter; any other leaf is other state.

Defaults: parameters are quantized, moments get `CompressionConfig.optimizer`, everything else is lossless.
A user overrides leaves with `CompressionConfig.policy_rules` ((regex, policy) on the key path) or per save with
labels (`InshrinkSave(labels=...)`: a callable `(path, leaf) -> policy | None`, or a tree of policies with the
structure of the state or a prefix of it, in the manner of optax's `multi_transform`). Labels win over rules,
rules over the defaults; a rule or label that matches no leaf is an error naming it.

Coupling (optax's Adam bias correction): a step counter beside a dropped second moment is dropped with it, and
the combinations that would make Adam's next updates huge are refused (`couple_counters`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import jax
import optax
from flax import nnx

from inshrink_jax.config import POLICIES, CompressionConfig

FIRST, SECOND = "first", "second"
# Per optax state type: field -> role. First moments are signed and follow their weight's pruning; second
# moments are non-negative (moments.py). A `count` field beside them is the counter of their bias correction.
MOMENT_FIELDS: dict[type, dict[str, str]] = {
    optax.ScaleByAdamState: {"mu": FIRST, "nu": SECOND},
    optax.ScaleByAmsgradState: {"mu": FIRST, "nu": SECOND, "nu_max": SECOND},
    optax.ScaleByBeliefState: {"mu": FIRST, "nu": SECOND},
    optax.ScaleByLionState: {"mu": FIRST},
    optax.ScaleByNovogradState: {"mu": FIRST, "nu": SECOND},
    optax.ScaleByRStdDevState: {"mu": FIRST, "nu": SECOND},
    optax.ScaleBySM3State: {"mu": FIRST, "nu": SECOND},
    optax.ScaleByRmsState: {"nu": SECOND},
    optax.ScaleByRssState: {"sum_of_squares": SECOND},
    optax.ScaleByAdaDeltaState: {"e_g": SECOND, "e_x": SECOND},
    optax.TraceState: {"trace": FIRST},
    optax.EmaState: {"ema": FIRST},
    optax.FactoredState: {"v_row": SECOND, "v_col": SECOND, "v": SECOND},
}


# A first moment whose update is normalized, not linear in it, is coded within this fraction of the first
# moments' budget (CompressionConfig.moment_budget). Lion's update is the sign of b1 * mu + (1 - b1) * g, so an
# error of mu flips whole steps rather than scaling them, and its mu is the slow average (b2 = 0.99): an error lasts
# ~100 steps, not the ~10 of Adam's mu (b1 = 0.9). Muon's is the orthogonal polar factor of its momentum (a matrix
# sign: every singular direction a unit step). At the full budget, 5 restores moved an MLP's final loss by +3.4%
# to +7.0% over three seeds with Lion and +1.8% to +4.5% with Muon (benchmarks/results/optimizers_full_budget.md),
# at this fraction by -0.8% to -1.1% and -0.7% to +2.0% (optimizers.md); 10 restores of a character transformer
# trained with Lion moved its loss by -9.0%, 4.8x its seed-to-seed noise, at the full budget, where the settings
# that stay near exact ended within +0.5% to +0.7% (benchmarks/results/fidelity_charlm-lion_previous.md, then
# fidelity_charlm-lion.md at this fraction).
NORMALIZED_BUDGET = 0.1
# Per optax state type: field -> the factor of the first-moment budget its moment is coded within (1 if absent).
MOMENT_BUDGETS: dict[type, dict[str, float]] = {optax.ScaleByLionState: {"mu": NORMALIZED_BUDGET}}
# Per optax state type: the fields that hold iterates of the parameters' shape (schedule-free's `z`, the
# sequence its parameters interpolate): optimizer state quantized as parameters are (closed loop), not exactly.
ITERATE_FIELDS: dict[type, tuple[str, ...]] = {}


def _unexported_states() -> None:
    """Add to `MOMENT_FIELDS`, `MOMENT_BUDGETS` and `ITERATE_FIELDS` the states optax does not export at its top
    level, where the installed optax has them: Muon's and schedule-free AdamW's (optax.contrib), and RMSProp's
    with a bias-correction counter (what schedule-free AdamW wraps)."""
    import importlib  # noqa: PLC0415

    def find(module: str, name: str):
        try:
            return getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None

    muon, rms = find("optax.contrib", "MuonState"), find("optax._src.transform", "ScaleByRmsWithCountState")
    free = find("optax.contrib", "ScheduleFreeState")
    if muon is not None:
        MOMENT_FIELDS[muon] = {"mu": FIRST}
        MOMENT_BUDGETS[muon] = {"mu": NORMALIZED_BUDGET}
    if rms is not None:
        MOMENT_FIELDS[rms] = {"nu": SECOND}
    if free is not None:
        ITERATE_FIELDS[free] = ("z",)


_unexported_states()
COUNTER = "count"
# Field sets that identify an optax state in a plain dict (a restore without a target, or NNX's mirror of an
# optax state): only states with a step counter, so a model dict with one module named `trace` or `nu` is never
# taken for one.
_DICT_SIGNATURES = {frozenset(t._fields): t for t in MOMENT_FIELDS if COUNTER in t._fields}
_ALL_MOMENT_FIELDS = {f for fields in MOMENT_FIELDS.values() for f in fields}
BATCH_STATS = "batch_stats"  # Linen's collection of batch statistics


@dataclasses.dataclass(frozen=True)
class LeafPolicy:
    """How one leaf is stored.

    Attributes:
      part: "params" (model parameters), "optimizer" (optimizer state) or "other" (anything else).
      policy: "quantize", "lossless" or "drop".
      moment: FIRST / SECOND for an optimizer moment, else None.
      counter: whether the leaf is the step counter of an optimizer state holding moments.
      group: key path of the optimizer state the moment or counter belongs to (for coupling), else None.
      mirror: for a moment, the key path inside its moment field: the path of the parameter it mirrors.
      explicit: whether a user rule or label chose `policy`.
      budget: for a first moment, the factor of `CompressionConfig.effective_moment_budget` it is coded within
        (`MOMENT_BUDGETS`).
    """

    part: str
    policy: str
    moment: str | None = None
    counter: bool = False
    group: str | None = None
    mirror: tuple = ()
    explicit: bool = False
    budget: float = 1.0


def _name(k) -> Any:
    return k.name if isinstance(k, jax.tree_util.GetAttrKey) else getattr(k, "key", getattr(k, "idx", None))


def _is_optax_state(x) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields") and type(x).__module__.startswith("optax")


def _dict_signature(x) -> type | None:
    """The optax state type whose fields are exactly the keys of the dict `x`, else None."""
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return _DICT_SIGNATURES.get(frozenset(x))
    return None


def _stop(x) -> bool:
    return x is None or isinstance(x, nnx.Variable) or _is_optax_state(x) or _dict_signature(x) is not None


def _structure(tree, prefix: tuple = (), ctx: tuple[LeafPolicy, int] | None = None) -> dict[str, LeafPolicy]:
    """Key path string -> the structural (default) policy of every leaf under `tree`, whose key path is
    `prefix`; `ctx` is (the policy of a field of an optax state, the length of that field's key path)."""
    out: dict[str, LeafPolicy] = {}
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_stop)[0]:
        full = prefix + tuple(path)
        if _is_optax_state(node) or _dict_signature(node) is not None:
            is_tuple = _is_optax_state(node)
            kind = type(node) if is_tuple else _dict_signature(node)
            fields = MOMENT_FIELDS.get(kind, {})
            group = jax.tree_util.keystr(full) if fields else None
            for name in (node._fields if is_tuple else tuple(node)):
                key = jax.tree_util.GetAttrKey(name) if is_tuple else jax.tree_util.DictKey(name)
                child = getattr(node, name) if is_tuple else node[name]
                iterate = name in ITERATE_FIELDS.get(kind, ())
                role = LeafPolicy("optimizer", "quantize" if iterate else "lossless", fields.get(name),
                                  name == COUNTER and bool(fields), group,
                                  budget=MOMENT_BUDGETS.get(kind, {}).get(name, 1.0))
                out.update(_structure(child, full + (key,), (role, len(full) + 1)))
        elif isinstance(node, nnx.Variable):
            for sub, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is None)[0]:
                out[jax.tree_util.keystr(full + tuple(sub))] = _nnx_policy(node, full + tuple(sub), leaf, ctx)
        else:
            out[jax.tree_util.keystr(full)] = _plain_policy(full, node, ctx)
    return out


def _plain_policy(path: tuple, leaf, ctx: tuple[LeafPolicy, int] | None) -> LeafPolicy:
    if ctx is not None:  # inside an optax state
        role, depth = ctx
        return dataclasses.replace(role, mirror=tuple(path[depth:])) if role.moment else role
    if any(_name(k) == BATCH_STATS for k in path) or not _is_float(leaf):
        return LeafPolicy("other", "lossless")
    return LeafPolicy("params", "quantize")


def _nnx_policy(var, path: tuple, leaf, ctx: tuple[LeafPolicy, int] | None) -> LeafPolicy:
    """The policy of a leaf of an NNX variable; `path` is the leaf's key path (ending in `.value`); `ctx` as
    `_structure`'s: an optimizer variable under a dict that mirrors an optax state (NNX keeps the fields of a
    state as the keys of a dict) takes that field's role, else the role of the first moment field on its path."""
    if isinstance(var, nnx.Param):
        return LeafPolicy("params", "quantize" if _is_float(leaf) else "lossless")
    if not isinstance(var, nnx.optimizer.OptState):
        return LeafPolicy("other", "lossless")
    if ctx is not None:
        return _plain_policy(path, leaf, ctx)
    names = [_name(k) for k in path]
    start = max((i for i, n in enumerate(names) if n == "opt_state"), default=-1) + 1
    for j in range(start, len(names)):
        if names[j] == COUNTER:
            return LeafPolicy("optimizer", "lossless", None, True, jax.tree_util.keystr(path[:j]))
        if names[j] in _ALL_MOMENT_FIELDS:
            role = FIRST if any(f.get(names[j]) == FIRST for f in MOMENT_FIELDS.values()) else SECOND
            return LeafPolicy("optimizer", "lossless", role, False, jax.tree_util.keystr(path[:j]),
                              tuple(path[j + 1:]))
    return LeafPolicy("optimizer", "lossless")


def _is_float(x) -> bool:
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.floating)
    except TypeError:  # a PRNG key's dtype
        return False


Labels = Callable[[tuple, Any], "str | None"] | Any


def classify(state, cfg: CompressionConfig, labels: Labels = None) -> list[LeafPolicy]:
    """The policy of every leaf of `state`, in `jax.tree_util.tree_flatten_with_path` order (None is a leaf).

    Args:
      state: the saved pytree.
      cfg: `policy_rules` and `optimizer` (the default policy of moments).
      labels: None; a callable `(key path, leaf) -> policy or None` (None: the rules and defaults decide); or a
        tree with the structure of `state`, or a prefix of it, whose leaves are policies or None.

    Raises:
      ValueError: a rule or label that matches no leaf, a label that is not a policy, a label tree that does not
        fit `state`, a step counter kept beside a dropped second moment (see `couple_counters`).
    """
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: x is None)[0]
    structural = _structure(state)
    keys = [jax.tree_util.keystr(p) for p, _ in flat]
    chosen = _labels(state, flat, labels)
    matched = [False] * len(cfg.policy_rules)
    out = []
    for key, (path, leaf), label in zip(keys, flat, chosen):
        base = structural[key]
        if base.moment is not None:
            base = dataclasses.replace(base, policy=cfg.optimizer)
        rule = next((r for r, (pattern, _) in enumerate(cfg.policy_rules) if re.search(pattern, key)), None)
        if rule is not None and _is_array(leaf):
            matched[rule] = True
        if label is not None:
            base = dataclasses.replace(base, policy=label, explicit=True)
        elif rule is not None and _is_array(leaf):
            base = dataclasses.replace(base, policy=cfg.policy_rules[rule][1], explicit=True)
        elif rule is not None and cfg.policy_rules[rule][1] != "lossless":
            raise ValueError(f"leaf {key} is a Python {type(leaf).__name__}, stored as is in the manifest; "
                             f"policy_rules apply to array leaves only. Narrow the rule {cfg.policy_rules[rule]!r}.")
        out.append(base)
    unused = [r for r, m in zip(cfg.policy_rules, matched) if not m]
    if unused:
        raise ValueError(f"CompressionConfig.policy_rules {unused} match no array leaf of the saved state (its key "
                         f"paths look like {keys[:3]}); fix the pattern or remove the rule.")
    return couple_counters(keys, out)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _labels(state, flat: list, labels: Labels) -> list:
    """Each leaf's label (a policy or None) from `labels` (see `classify`)."""
    if labels is None:
        return [None] * len(flat)
    if callable(labels):
        out = [labels(path, leaf) for path, leaf in flat]
        if all(x is None for x in out):
            raise ValueError("InshrinkSave(labels=...): the labelling function returned None for every leaf; "
                             "it labels nothing.")
    else:
        try:
            spread = jax.tree_util.tree_map(lambda lab, sub: [lab] * len(jax.tree_util.tree_leaves(
                sub, is_leaf=lambda x: x is None)), labels, state, is_leaf=lambda x: x is None or isinstance(x, str))
            out = [x for xs in jax.tree_util.tree_leaves(spread, is_leaf=lambda x: isinstance(x, list)) for x in xs]
        except (ValueError, TypeError) as e:
            raise ValueError(f"InshrinkSave(labels=...) must have the structure of the saved state or a prefix of "
                             f"it ({e})") from None
        if len(out) != len(flat) or all(x is None for x in out):
            raise ValueError("InshrinkSave(labels=...) labels no leaf of the saved state; give a policy name "
                             f"({', '.join(POLICIES)}) where the default should not apply.")
    for (path, _), x in zip(flat, out):
        if x is not None and x not in POLICIES:
            raise ValueError(f"InshrinkSave(labels=...): leaf {jax.tree_util.keystr(path)} is labelled {x!r}; a "
                             f"label is one of {POLICIES} or None")
    return out


def couple_counters(keys: Sequence[str], policies: list[LeafPolicy]) -> list[LeafPolicy]:
    """An optax step counter beside a dropped second moment is dropped too (restored as 0): Adam's bias
    correction then restarts with its moments. Refuse the combinations that make Adam's next updates huge."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(policies):
        if p.group is not None:
            groups.setdefault(p.group, []).append(i)
    out = list(policies)
    for group, members in groups.items():
        counters = [i for i in members if out[i].counter]
        seconds = [i for i in members if out[i].moment == SECOND]
        firsts = [i for i in members if out[i].moment == FIRST]
        second_dropped = any(out[i].policy == "drop" for i in seconds)
        if not counters or not seconds:
            continue
        for i in counters:
            if second_dropped and not out[i].explicit:
                out[i] = dataclasses.replace(out[i], policy="drop")
        counter_dropped = any(out[i].policy == "drop" for i in counters)
        kept_first = [keys[i] for i in firsts if out[i].policy != "drop"]
        if second_dropped and not counter_dropped:
            raise ValueError(f"optimizer state {group or '<root>'}: the second moment {keys[seconds[0]]} is dropped "
                             f"but its step counter {keys[counters[0]]} is kept, so after a restore Adam's bias correction would "
                             "divide by a second moment that restarts at 0: updates up to ~30x too large. Drop "
                             "the counter too, or keep the second moment.")
        if counter_dropped and kept_first:
            why = (f"the second moment {keys[seconds[0]]} is dropped, so its step counter is reset with it,"
                   if second_dropped
                   else "the step counter is dropped (reset to 0)")
            raise ValueError(f"optimizer state {group or '<root>'}: {why} but the first moment {kept_first[0]} is "
                             "kept, so Adam's bias correction would multiply it by 1 / (1 - b1) on the next step. "
                             "Drop the first moment too, or keep the second moment and the counter.")
    return out
