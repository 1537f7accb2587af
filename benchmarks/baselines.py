"""Baseline checkpoint formats for the fault-tolerance benchmark, each stored through Orbax's own
`StandardSave` (so bytes on disk include Orbax's zstd and metadata, as for the default format).

Each baseline is a pair of jitted per-leaf maps on the parameter tree; the optimizer state and step go to a
second item unchanged (Orbax's default format) unless the baseline says otherwise. Like inshrink_jax, only float
leaves with >= 1024 elements and >= 2 dimensions are transformed; the rest are stored as they are.

- orbax:   Orbax's default checkpoint of the whole state (float32, zstd level 1).
- bf16:    every float leaf of the whole state (parameters and Adam moments) cast to bfloat16.
- qd8:     QD-Compressor-like: uniform 8-bit quantization per tensor (min/max affine); a keyframe every
           `cycle` saves, the saves between store the 8-bit quantized difference from the previous save's
           dequantized weights (closed loop: the error does not accumulate); a fresh process starts a new cycle.
- cnr4:    Check-N-Run-like adaptive uniform quantization: 4 bits per weight, per tensor asymmetric range chosen
           by a greedy search that shrinks [min, max] from either end while the squared error falls; no delta
           (every weight of a dense model changes between checkpoints).
- excp:    ExCP-like weight-momentum joint shrinking (Li et al., 2024): a keyframe every `cycle` saves stores the
           parameters as Orbax does; a save between stores the residual against the previous save's
           reconstruction (closed loop, as qd8), pruned jointly with Adam's moments: a residual is kept where
           |dw| / sqrt(nu / mean(nu)) exceeds twice its tensor's mean (weights whose second moment is small
           move on purpose), the moments only where the residual is kept or |mu| exceeds twice its tensor's mean;
           every kept value is quantized to 16 non-uniform levels (the tensor's quantile midpoints), stored as
           uint8 codes with the masks packed to bits. Pruned moments restore as 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def _compressible(x) -> bool:
    return (isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2
            and x.size >= 1024)


@functools.partial(jax.jit, static_argnums=1)
def _uniform(w, levels: int):
    """(uint8 codes, lo, step) of min/max uniform quantization to `levels` levels."""
    lo, hi = jnp.min(w), jnp.max(w)
    step = jnp.maximum(hi - lo, 1e-30) / (levels - 1)
    return jnp.clip(jnp.round((w - lo) / step), 0, levels - 1).astype(jnp.uint8), lo, step


@functools.partial(jax.jit, static_argnums=1)
def _greedy_uniform(w, levels: int):
    """Check-N-Run's adaptive asymmetric range: from [min, max], repeatedly move whichever end lowers the squared
    error more by 1/128 of the range, while it falls (at most 64 moves)."""
    lo0, hi0 = jnp.min(w), jnp.max(w)
    delta = (hi0 - lo0) / 128

    def err(lo, hi):
        step = jnp.maximum(hi - lo, 1e-30) / (levels - 1)
        q = jnp.clip(jnp.round((w - lo) / step), 0, levels - 1) * step + lo
        return jnp.sum((q - w) ** 2)

    def body(carry):
        lo, hi, e, _, i = carry
        e_lo, e_hi = err(lo + delta, hi), err(lo, hi - delta)
        better = jnp.minimum(e_lo, e_hi) < e
        lo2 = jnp.where(better & (e_lo <= e_hi), lo + delta, lo)
        hi2 = jnp.where(better & (e_hi < e_lo), hi - delta, hi)
        return lo2, hi2, jnp.minimum(e, jnp.minimum(e_lo, e_hi)), better, i + 1

    lo, hi, _, _, _ = jax.lax.while_loop(lambda c: c[3] & (c[4] < 64), body,
                                         (lo0, hi0, err(lo0, hi0), jnp.bool_(True), 0))
    step = jnp.maximum(hi - lo, 1e-30) / (levels - 1)
    return jnp.clip(jnp.round((w - lo) / step), 0, levels - 1).astype(jnp.uint8), lo, step


def _dequant(codes, lo, step):
    return codes.astype(jnp.float32) * step + lo


def _levels16(x: np.ndarray, mask: np.ndarray) -> dict:
    """16 non-uniform levels of the masked values (quantile midpoints), their uint8 codes and the packed mask."""
    vals = x[mask]
    if vals.size == 0:
        centres = np.zeros(16, np.float32)
        codes = np.zeros(0, np.uint8)
    else:
        edges = np.quantile(vals, np.linspace(0, 1, 17))
        centres = ((edges[:-1] + edges[1:]) / 2).astype(np.float32)
        codes = np.abs(vals[:, None] - centres[None, :]).argmin(1).astype(np.uint8)
    return {"mask": np.packbits(mask.reshape(-1)), "codes": codes, "centres": centres}


def _unlevel(e: dict, shape) -> np.ndarray:
    n = int(np.prod(shape))
    mask = np.unpackbits(np.asarray(e["mask"]))[:n].astype(bool)
    out = np.zeros(n, np.float32)
    out[mask] = np.asarray(e["centres"])[np.asarray(e["codes"])]
    return out.reshape(shape)


def _excp_shrink(dw: np.ndarray, mu: np.ndarray, nu: np.ndarray) -> tuple[dict, dict, dict]:
    """ExCP-like joint masks and 16-level codes of a residual and its Adam moments (all float32, one shape)."""
    scale = np.sqrt(nu / max(float(nu.mean()), 1e-30)) + 1e-8
    score = np.abs(dw) / scale
    keep_w = score > 2 * score.mean()
    keep_m = keep_w | (np.abs(mu) > 2 * np.abs(mu).mean())
    return _levels16(dw, keep_w), _levels16(mu, keep_m), _levels16(nu, keep_m)


def _batch_stats(state) -> dict:
    """{"batch_stats": ...} of a TrainState that carries a model's batch statistics, else {}."""
    stats = getattr(state, "batch_stats", None)
    return {} if stats is None else {"batch_stats": stats}


class Baseline:
    """One baseline format: `save`/`restore` through a CheckpointManager with items "params" and "rest"."""

    def __init__(self, name: str, cycle: int = 10):
        if name not in ("orbax", "bf16", "qd8", "cnr4", "excp"):
            raise ValueError(f"unknown baseline {name!r}")
        self.name, self.cycle = name, cycle
        self._prev = None  # qd8: (step index in the cycle, dequantized parameters of the previous save)
        self._last_step = None  # qd8: the step of the previous save (a delta's base)

    def manager(self, root: str) -> ocp.CheckpointManager:
        # Every step is kept: a qd8 delta needs the saves back to its keyframe (the ratio counts every save).
        return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=None))

    def _encode(self, params):
        if self.name == "bf16":
            return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if _compressible(x) else x, params)
        if self.name == "cnr4":
            return jax.tree.map(lambda x: dict(zip(("codes", "lo", "step"), _greedy_uniform(x, 16)))
                                if _compressible(x) else x, params)
        if self.name == "qd8":
            keyframe = self._prev is None or self._prev[0] + 1 >= self.cycle
            index = 0 if keyframe else self._prev[0] + 1
            flat, treedef = jax.tree.flatten(params)
            prev = [None] * len(flat) if keyframe else jax.tree.leaves(self._prev[1])
            enc, recon = [], []
            for x, p in zip(flat, prev):
                if not _compressible(x):
                    enc.append(x)
                    recon.append(x)
                    continue
                codes, lo, step = _uniform(x if keyframe else x - p, 256)
                enc.append({"codes": codes, "lo": lo, "step": step})
                recon.append(_dequant(codes, lo, step) + (0 if keyframe else p))
            self._prev = (index, jax.tree.unflatten(treedef, recon))
            return {"delta": np.int32(0 if keyframe else 1), "tree": jax.tree.unflatten(treedef, enc)}
        return params

    def _rest(self, state):
        """What the "rest" item stores: the step, the optimizer state and the batch statistics of a model that
        has them (bf16: its float leaves cast)."""
        rest = {"step": state.step, "opt_state": state.opt_state, **_batch_stats(state)}
        if self.name != "bf16":
            return rest
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if isinstance(x, jax.Array)
                            and jnp.issubdtype(x.dtype, jnp.floating) else x, rest)

    def _excp_save(self, mngr, step: int, state):
        """Parameters: a keyframe or shrunk residuals; moments: shrunk (module docstring)."""
        if _batch_stats(state):
            raise ValueError("the excp baseline stores the parameters and the optimizer state only; this state "
                             "has batch statistics")
        keyframe = self._prev is None or self._prev[0] + 1 >= self.cycle
        flat, treedef = jax.tree_util.tree_flatten_with_path(state.params)
        opt_flat, _ = jax.tree_util.tree_flatten_with_path(state.opt_state)
        moments = {jax.tree_util.keystr(p): np.asarray(x) for p, x in opt_flat}
        prev = [None] * len(flat) if keyframe else jax.tree.leaves(self._prev[1])
        enc, recon, opt = [], [], {}
        for (path, x), p in zip(flat, prev):
            key = jax.tree_util.keystr(path)
            mu_key = next((k for k in moments if k.endswith(".mu" + key)), None)
            nu_key = next((k for k in moments if k.endswith(".nu" + key)), None)
            if not _compressible(x) or mu_key is None or nu_key is None:
                enc.append(x)
                recon.append(x)
                continue
            w = np.asarray(x, np.float32)
            dw = np.zeros_like(w) if keyframe else w - p
            e_w, opt[mu_key], opt[nu_key] = _excp_shrink(dw, moments[mu_key], moments[nu_key])
            if keyframe:
                enc.append(x)
                recon.append(w)
            else:
                enc.append(e_w)
                recon.append(p + _unlevel(e_w, w.shape))
        self._prev = (0 if keyframe else self._prev[0] + 1, jax.tree.unflatten(treedef, recon))
        params = {"delta": np.int32(0 if keyframe else 1), "tree": jax.tree.unflatten(treedef, enc),
                  "prev_step": np.int32(step if keyframe else self._last_step)}
        self._last_step = step
        rest = {"step": state.step, "opt": [opt.get(jax.tree_util.keystr(p), x) for p, x in opt_flat]}
        return mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                       rest=ocp.args.StandardSave(rest)))

    def _excp_restore(self, mngr, step: int, like_state):
        params = self._decode_params(mngr, step, like_state.params)
        rest = mngr.restore(step, args=ocp.args.Composite(rest=ocp.args.StandardRestore()))["rest"]
        like_opt, treedef = jax.tree.flatten(like_state.opt_state)
        opt = [jnp.asarray(_unlevel(e, l.shape), l.dtype) if isinstance(e, dict) else jnp.asarray(e, l.dtype)
               for e, l in zip(rest["opt"], like_opt)]
        self._prev = None
        return like_state.replace(params=params, step=type(like_state.step)(rest["step"]),
                                  opt_state=jax.tree.unflatten(treedef, opt))

    def save(self, mngr, step: int, state):
        if self.name == "excp":
            return self._excp_save(mngr, step, state)
        if self.name == "orbax":
            return mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                                                           rest=ocp.args.StandardSave(self._rest(state))))
        rest = self._rest(state)
        params = self._encode(state.params)
        if self.name == "qd8":
            params = {**params, "prev_step": np.int32(step if params["delta"] == 0 else self._last_step)}
            self._last_step = step
        return mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                       rest=ocp.args.StandardSave(rest)))

    def _decode_params(self, mngr, step: int, like):
        raw = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))["params"]
        if self.name in ("qd8", "excp"):
            base = None if int(raw["delta"]) == 0 else self._decode_params(mngr, int(raw["prev_step"]), like)
            tree = raw["tree"]
        else:
            base, tree = None, raw
        leaves, treedef = jax.tree.flatten(like)
        is_enc = lambda x: isinstance(x, dict) and "codes" in x  # noqa: E731
        enc = treedef.flatten_up_to(tree)
        bases = [None] * len(leaves) if base is None else jax.tree.leaves(base)
        out = []
        for x, e, b in zip(leaves, enc, bases):
            if is_enc(e) and "mask" in e:  # excp: a shrunk residual
                out.append(jnp.asarray(np.asarray(b) + _unlevel(e, x.shape), x.dtype))
            elif is_enc(e):
                v = _dequant(jnp.asarray(e["codes"]), jnp.asarray(e["lo"]), jnp.asarray(e["step"]))
                out.append(v if b is None else v + b)
            else:
                out.append(jnp.asarray(e).astype(x.dtype))
        return jax.tree.unflatten(treedef, out)

    def restore(self, mngr, step: int, like_state):
        """The state saved at `step`, with the structure and dtypes of `like_state`; a fresh process starts a
        new qd8 / excp cycle."""
        if self.name == "excp":
            return self._excp_restore(mngr, step, like_state)
        params = self._decode_params(mngr, step, like_state.params)
        target = self._rest(like_state)
        rest = mngr.restore(step, args=ocp.args.Composite(rest=ocp.args.StandardRestore(target)))["rest"]
        rest = jax.tree.map(lambda like, r: r.astype(like.dtype) if isinstance(like, jax.Array) else r,
                            {"step": like_state.step, "opt_state": like_state.opt_state,
                             **_batch_stats(like_state)}, rest)
        self._prev = None
        return like_state.replace(params=params, **rest)
