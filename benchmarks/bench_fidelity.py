"""Fidelity: does training that fails and resumes 10 times from compressed checkpoints end where uninterrupted
training ends, and at what size? inshrink_jax's knob settings and the baselines in one run, against the noise
floor of each workload measured with three seeds.

Usage:
  python benchmarks/bench_fidelity.py --workload charlm --out benchmarks/results/fidelity_charlm.md
  python benchmarks/bench_fidelity.py --workload mnist  --out benchmarks/results/fidelity_mnist.md
  python benchmarks/bench_fidelity.py --workload longlm --methods inshrink qd8 orbax --out ...
  python benchmarks/bench_fidelity.py --workload lstm --out benchmarks/results/fidelity_lstm.md
(needs the `bench` extra: pip install -e '.[bench]')

Workloads (the harness, failures and figures are those of bench_fault_tolerance.py):
  mnist   the MNIST CNN, 1500 steps, a checkpoint every 50, quality = test accuracy.
  charlm  a 2-layer character transformer (440k parameters), 600 steps with cosine decay, a checkpoint every 30:
          the harsh spacing (a restore every 60 steps, each 15 steps after a save).
  charlm-lion  the same transformer, data and spacing trained with Lion (peak 1e-3, weight decay 0.1): its
          one optimizer moment `mu` is the slow average (b2 = 0.99) and its update the sign of a blend of it and
          the gradient, not linear in it as Adam's and SGD momentum's are.
  charlm-muon  the same with Muon (optax.contrib.muon, peak 0.02) on the matrices and AdamW on the rest: Muon's
          update is the orthogonal polar factor of its momentum, a matrix sign.
  charlm-schedule-free  the same with schedule-free AdamW (3e-3, 50 warm-up steps): its state holds `z`, an
          iterate of the parameters' shape.
  longlm  a 3-layer character transformer (1.39M parameters, context 64, batch 16), 3000 steps with cosine
          decay, a checkpoint every 100: ten restores spread over the whole run.
  lstm    a fine-tune: textgenrnn's pretrained character LSTM (462k parameters, examples/textgen.py) on Python's
          reference text, 1000 steps with cosine decay, a checkpoint every 50. Its weights come from the
          textgenrnn sdist, downloaded by pip on first use (`h5py` from the `bench` extra reads them).
  resnet  the other common recipe, on MNIST: a residual network with batch normalization (112k parameters;
          its state holds `batch_stats`, stored exactly) trained with SGD, Nesterov momentum 0.9 (the optimizer
          state is SGD's `trace`, not Adam's moments) and weight decay, 1500 steps with cosine decay, a
          checkpoint every 50, quality = test accuracy. The excp baseline does not store batch statistics and
          refuses this workload.
  vit     an architecture the defaults were never tuned on: a vision transformer on MNIST (4 layers of width 64,
          4 heads, 16 patches of 7x7, pre-norm, learned position embeddings, mean-pooled; 138k parameters),
          AdamW 1e-3 with cosine decay over 1500 steps and weight decay 1e-4, batch 128, a checkpoint every 50,
          quality = test accuracy.
  mixer   a second held-out architecture: an MLP-Mixer on MNIST (4 blocks of width 64, 49 patches of 4x4, token
          MLP 64, channel MLP 128; 94k parameters) with global-norm clipping and AdamW (2e-3, 100 warm-up steps,
          cosine decay over 1500 steps, weight decay 1e-4): its optimizer state is a chain's tuple, batch 128, a
          checkpoint every 50, quality = test accuracy.
  mixer-muon  the same MLP-Mixer, data and spacing with Muon (peak 0.02, the same warm-up and decay) on its
          matrices and AdamW on the rest (its patch convolution, biases and layer norms): a second Muon workload.
Noise floor: the largest |relative difference| of the final quality of seeds 1 and 2 from seed 0 (uninterrupted,
no checkpoints); a method is "within noise" when its degradation is at most that.

Methods: inshrink (the default configuration: CompressionConfig() with a GradientEMA and the eval_fn),
inshrink[epsilon=E] (the knob: every data-free budget follows it), inshrink-rb<B> (residual_budget=B alone),
inshrink-open (the paper's open-loop saves,
closed_loop=False), inshrink[key=value;...] (any CompressionConfig fields, e.g. 'inshrink[moment_bins=4]'),
each also as inshrink-kmeans... (residual_space=config.KMEANS_RESIDUAL_SPACE, e.g. inshrink-kmeans-rb0.4) or
inshrink-entropy... (residual_space=config.ENTROPY_RESIDUAL_SPACE),
and the baselines orbax, bf16, qd8, cnr4, excp (baselines.py).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import pickle
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_fault_tolerance as ft  # noqa: E402
import charlm  # noqa: E402  (examples/, on the path through bench_fault_tolerance)
import mnist  # noqa: E402
import report  # noqa: E402

KNOBS = (0.001, 0.005, 0.02, 0.05)  # epsilon, the knob (0.01 is the default)
METHODS = (["inshrink"] + [f"inshrink[epsilon={e}]" for e in KNOBS] + ["inshrink-open", "orbax", "bf16", "qd8",
                                                                      "cnr4", "excp"])


class LongLM(ft.CharLM):
    """A longer run of a larger character transformer (module docstring)."""

    name, steps, every, metric, higher = "longlm", 3000, 100, "loss", False
    D, LAYERS, CONTEXT, BATCH = 192, 3, 64, 16

    def __init__(self, seed: int, steps: int):
        self.train, held, self.vocab = charlm.load()
        self.seed, self.total = seed, steps
        rng = np.random.default_rng(12345)
        half = len(held) // 2
        self.eval = tuple(map(jnp.asarray, charlm.windows(held[:half], rng.integers(0, half - 65, 64), 64)))
        self.test = tuple(map(jnp.asarray, charlm.windows(held[half:], rng.integers(0, len(held) - half - 65, 256),
                                                          64)))

    def describe(self, steps):
        return (f"character transformer (1.39M parameters: width {self.D}, {self.LAYERS} layers, context "
                f"{self.CONTEXT}, vocabulary {self.vocab}), AdamW 3e-3 with cosine decay over {steps} steps, batch "
                f"{self.BATCH}; quality = loss on 256 held-out windows, eval_fn = loss on 64 others")

    def create_state(self):
        return charlm.create_state(self.vocab, self.seed, steps=self.total, d=self.D, layers=self.LAYERS,
                                   context=self.CONTEXT)

    def batch(self, step: int):
        starts = np.random.default_rng((self.seed, step)).integers(0, len(self.train) - self.CONTEXT - 1, self.BATCH)
        return charlm.windows(self.train, starts, self.CONTEXT)


class CharLMOptimizer(ft.CharLM):
    """The 440k character transformer trained with another optimizer (`charlm.create_state`'s `optimizer`, at
    `PEAK_LR`), described by replacing `REPLACE` in CharLM's description with `TEXT` (module docstring)."""

    OPTIMIZER, PEAK_LR, REPLACE, TEXT = "adamw", 3e-3, "", ""

    def describe(self, steps):
        return super().describe(steps).replace(self.REPLACE, self.TEXT)

    def create_state(self):
        return charlm.create_state(self.vocab, self.seed, steps=self.total, peak_lr=self.PEAK_LR,
                                   optimizer=self.OPTIMIZER)


class CharLMLion(CharLMOptimizer):
    name, OPTIMIZER, PEAK_LR = "charlm-lion", "lion", 1e-3
    REPLACE, TEXT = "AdamW 3e-3", "Lion 0.001 (weight decay 0.1)"


class CharLMMuon(CharLMOptimizer):
    name, OPTIMIZER = "charlm-muon", "muon"
    REPLACE, TEXT = "AdamW 3e-3", f"Muon {charlm.MUON_LR:g} on the matrices, AdamW 3e-3 on the rest (weight decay 0.01)"


class CharLMScheduleFree(CharLMOptimizer):
    name, OPTIMIZER = "charlm-schedule-free", "schedule-free"
    REPLACE = "AdamW 3e-3 with cosine decay"
    TEXT = ("schedule-free AdamW 3e-3 (50 warm-up steps, weight decay 0.01; quality and eval_fn at the parameters, "
            "the point gradients are taken at)")


class LSTMFineTune(ft.Workload):
    """Fine-tuning a pretrained character LSTM on text of another domain (module docstring)."""

    name, steps, every, metric, higher = "lstm", 1000, 50, "loss", False
    BATCH = 128

    def __init__(self, seed: int, steps: int):
        import textgen  # examples/, on the path through bench_fault_tolerance

        self.textgen, (self.params, vocab) = textgen, textgen.pretrained()
        self.train, held = textgen.corpus(vocab)
        self.seed, self.total = seed, steps
        rng = np.random.default_rng(12345)  # the same held-out windows for every seed
        half = len(held) // 2
        self.eval = tuple(map(jnp.asarray, textgen.windows(held[:half], rng.integers(0, half - 41, 512))))
        self.test = tuple(map(jnp.asarray, textgen.windows(held[half:], rng.integers(0, len(held) - half - 41,
                                                                                      4096))))

    def describe(self, steps):
        return (f"textgenrnn's pretrained character LSTM (462k parameters: embedding, 2 LSTM layers of 128, "
                f"attention; pretrained on web text) fine-tuned on Python's reference text, Adam 1e-3 with cosine "
                f"decay and gradients clipped to norm 1 over {steps} steps, batch {self.BATCH} windows of 40 characters predicting the next; "
                "quality = loss on 4,096 held-out windows, eval_fn = loss on 512 others; seeds differ in data order "
                "only (every run starts from the same pretrained weights)")

    def create_state(self):
        return self.textgen.create_state(self.params, self.total)

    def batch(self, step: int):
        starts = np.random.default_rng((self.seed, step)).integers(0, len(self.train) - 41, self.BATCH)
        return self.textgen.windows(self.train, starts)

    def quality(self, state) -> tuple[float, float]:
        """(loss, loss) on the test windows (the loss is the metric)."""
        loss = float(self.loss(state, *self.test))
        return loss, loss


class ScheduledMnist(ft.Mnist):
    """An MNIST workload whose learning-rate schedule spans `steps` (its optimizer is built for the run's length)."""

    def __init__(self, seed: int, steps: int):
        super().__init__(seed)
        self.total = steps


class ResNetSGD(ScheduledMnist):
    """A residual network with batch normalization on MNIST, trained with SGD and momentum (module docstring)."""

    name = "resnet"

    def describe(self, steps):
        return (f"MNIST residual network with batch normalization (112k parameters; examples/mnist.py ResNet), SGD "
                f"0.1 with Nesterov momentum 0.9, cosine decay over {steps} steps and weight decay 5e-4, batch "
                f"{self.batch_size}; quality on 8,000 test images, eval_fn = loss on the other 2,000")

    def create_state(self):
        return mnist.create_resnet_state(self.seed, self.total)

    train_step = staticmethod(mnist.resnet_train_step)

    def logits(self, state, x):
        return mnist.resnet_logits(state, x)

    def loss(self, state, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(self.logits(state, x), y).mean()


class ViT(nn.Module):
    """A small vision transformer for 28x28 images: 7x7 patches (16 tokens) embedded to `width`, learned position
    embeddings, `depth` pre-norm blocks (multi-head self-attention and a GELU MLP of twice the width), a final
    layer norm, mean pooling and a dense classifier."""

    width: int = 64
    depth: int = 4
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.width, (7, 7), strides=(7, 7), padding="VALID")(x)
        x = x.reshape(x.shape[0], -1, self.width)
        x = x + self.param("position", nn.initializers.normal(0.02), (1, x.shape[1], self.width))
        for _ in range(self.depth):
            x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
            y = nn.Dense(2 * self.width)(nn.LayerNorm()(x))
            x = x + nn.Dense(self.width)(nn.gelu(y))
        return nn.Dense(10)(jnp.mean(nn.LayerNorm()(x), axis=1))


class FlaxMnist(ScheduledMnist):
    """An MNIST workload of a Flax module (`module`) trained by an optax transformation (`optimizer`)."""

    def module(self) -> nn.Module:
        raise NotImplementedError

    def optimizer(self) -> optax.GradientTransformation:
        raise NotImplementedError

    def thousands(self) -> int:
        """The model's parameters, in thousands (for `describe`)."""
        return sum(x.size for x in jax.tree.leaves(self.create_state().params)) // 1000

    def create_state(self):
        model = self.module()
        params = model.init(jax.random.PRNGKey(self.seed), jnp.zeros((1, 28, 28, 1)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=self.optimizer())


class ViTAdamW(FlaxMnist):
    """A vision transformer on MNIST with AdamW and cosine decay (module docstring): the held-out workload."""

    name = "vit"

    def describe(self, steps):
        return (f"MNIST vision transformer ({self.thousands()}k parameters: 4 layers of width 64, 4 heads, 16 patches "
                f"of 7x7), AdamW 1e-3 with cosine decay over {steps} steps and weight decay 1e-4, batch "
                f"{self.batch_size}; quality on 8,000 test images, eval_fn = loss on the other 2,000")

    def module(self):
        return ViT()

    def optimizer(self):
        return optax.adamw(optax.cosine_decay_schedule(1e-3, self.total), weight_decay=1e-4)


class Mixer(nn.Module):
    """An MLP-Mixer for 28x28 images: 4x4 patches (49 tokens) embedded to `width`, `depth` pre-norm blocks (a
    token-mixing MLP across the patches, then a channel-mixing MLP of twice the width, each GELU and residual), a
    final layer norm, mean pooling and a dense classifier."""

    width: int = 64
    depth: int = 4
    tokens_hidden: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.width, (4, 4), strides=(4, 4), padding="VALID")(x)
        x = x.reshape(x.shape[0], -1, self.width)
        for _ in range(self.depth):
            y = nn.LayerNorm()(x).swapaxes(1, 2)
            y = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(self.tokens_hidden)(y)))
            x = x + y.swapaxes(1, 2)
            x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))
        return nn.Dense(10)(jnp.mean(nn.LayerNorm()(x), axis=1))


class MixerAdamW(FlaxMnist):
    """An MLP-Mixer on MNIST with gradient clipping and AdamW on a warm-up and cosine schedule (module docstring):
    a second held-out workload, with a chained optimizer state."""

    name = "mixer"

    def describe(self, steps):
        return (f"MNIST MLP-Mixer ({self.thousands()}k parameters: 4 blocks of width 64, 49 patches of 4x4), "
                f"global-norm clipping at 1 then AdamW 2e-3 with 100 warm-up steps and cosine decay over {steps} "
                f"steps, weight decay 1e-4, batch {self.batch_size}; quality on 8,000 test images, eval_fn = loss on "
                "the other 2,000")

    def module(self):
        return Mixer()

    def optimizer(self):
        schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 100, self.total)
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


class MixerMuon(MixerAdamW):
    """The MLP-Mixer with Muon on its matrices (module docstring): a second Muon workload, of another
    architecture and data than charlm-muon's."""

    name = "mixer-muon"

    def describe(self, steps):
        return super().describe(steps).replace(
            "AdamW 2e-3", f"Muon {charlm.MUON_LR:g} on the matrices and AdamW 2e-3 on the rest")

    def optimizer(self):
        adam = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 100, self.total)
        muon = optax.warmup_cosine_decay_schedule(0.0, charlm.MUON_LR, 100, self.total)
        return optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(
            muon, weight_decay=1e-4, adam_learning_rate=adam, adam_weight_decay=1e-4))


WORKLOADS = {"mnist": ft.Mnist, "charlm": ft.CharLM, "charlm-lion": CharLMLion, "charlm-muon": CharLMMuon,
             "charlm-schedule-free": CharLMScheduleFree, "longlm": LongLM, "lstm": LSTMFineTune, "resnet": ResNetSGD,
             "vit": ViTAdamW, "mixer": MixerAdamW, "mixer-muon": MixerMuon}


def method(name: str):
    """A method of the table: inshrink_jax at a setting (`inshrink`, then optionally `-kmeans` or `-entropy`,
    then one of `-open`, `-rb<B>` or `[key=value;...]`), or a baseline."""
    if not name.startswith("inshrink"):
        return ft.Baseline(name)
    rest, kw = name[len("inshrink"):], {}
    if rest.startswith("-kmeans"):
        kw["residual_space"], rest = ft.ij.config.KMEANS_RESIDUAL_SPACE, rest[len("-kmeans"):]
    elif rest.startswith("-entropy"):
        kw["residual_space"], rest = ft.ij.config.ENTROPY_RESIDUAL_SPACE, rest[len("-entropy"):]
    if rest == "-open":
        kw["closed_loop"] = False
    elif rest.startswith("-rb"):
        kw["residual_budget"] = float(rest[len("-rb"):])
    elif rest.startswith("[") and rest.endswith("]"):
        kw.update(overrides(rest[1:-1]))
    elif rest:
        raise ValueError(f"unknown method {name!r}")
    ft.ij.CompressionConfig(**kw)  # a bad field fails here, not mid-run
    return ft.Inshrink(name, kw.pop("epsilon", ft.ij.CompressionConfig().epsilon), **kw)


def overrides(spec: str) -> dict:
    """`key=value;key=value` (Python literals) as CompressionConfig fields, e.g. `moment_bins=4`; a dict for a
    field whose default is a dataclass replaces those of its fields, e.g. `residual_space={"bins": (3,)}`."""
    out, defaults = {}, ft.ij.CompressionConfig()
    for item in filter(None, spec.split(";")):
        key, _, value = item.partition("=")
        key, value = key.strip(), ast.literal_eval(value.strip())
        default = getattr(defaults, key, None)
        out[key] = (dataclasses.replace(default, **value) if isinstance(value, dict) and
                    dataclasses.is_dataclass(default) else value)
    return out


def method_name(name: str) -> str:
    """argparse type of --methods: a listed method or an inshrink_jax setting (see `method`)."""
    if name in METHODS:
        return name
    if name.startswith("inshrink"):
        try:
            method(name)
            return name
        except (ValueError, TypeError, SyntaxError) as e:
            raise argparse.ArgumentTypeError(f"{name!r}: {e}") from None
    raise argparse.ArgumentTypeError(f"unknown method {name!r}: one of {', '.join(METHODS)} or "
                                     "inshrink[-kmeans|-entropy][-open|-rb<B>|[key=value;...]]")


def spike(r: dict) -> str:
    """The paired training-loss figure of a row ('' for rows measured before it was recorded)."""
    return f"{r['spike']:+.2%}" if "spike" in r else ""


def frontier_plot(rows: dict, noise: float, work, path: str):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, r in rows.items():
        ours = name.startswith("inshrink")
        ax.scatter(r["written"], 100 * r["degradation"][0], marker="o" if ours else "s",
                   color="tab:blue" if ours else "tab:red")
        ax.annotate(name, (r["written"], 100 * r["degradation"][0]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.axhspan(-100 * noise, 100 * noise, color="grey", alpha=0.2, label="noise floor (3 seeds)")
    ax.set_xscale("log")
    ax.set_xlabel("bytes written over the run (whole checkpoint, log)")
    ax.set_ylabel(f"final {work.metric} degradation after 10 restores (%)")
    ax.set_title(f"{work.name}: size against fidelity")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="charlm")
    ap.add_argument("--methods", nargs="+", default=METHODS, type=method_name)
    ap.add_argument("--failures", type=int, default=10)
    ap.add_argument("--failures-from", type=int, default=0, metavar="STEP",
                    help="spread the failures evenly over the steps after STEP instead of the whole run (the "
                         "paper's spacing: restores once training has converged part way)")
    ap.add_argument("--out", default=None, help="markdown table; the frontier plot (.png) and figures (.json) beside")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="instead of running: one table of the runs in these figure files (invocations of this "
                         "workload with the same --cache, e.g. ours and the baselines run side by side)")
    ap.add_argument("--rename", nargs="+", default=(), metavar="OLD=>NEW",
                    help="with --merge: give the row OLD the name NEW in the table (a row run under an explicit "
                         "setting that a later release made the default, or a default that a later release changed)")
    ap.add_argument("--cache", default=None, help="directory keeping the uninterrupted reference runs between "
                                                  "invocations (they do not depend on the methods)")
    ap.add_argument("--references", default=None, metavar="JSON",
                    help="take the uninterrupted reference runs from this figure file of an earlier invocation of "
                         "this workload (they do not depend on inshrink_jax) instead of running them")
    args = ap.parse_args(argv)
    cls = WORKLOADS[args.workload]
    steps, every = cls.steps, cls.every

    def make(seed):
        return cls(seed) if cls is ft.Mnist else cls(seed, steps)

    if not 0 <= args.failures_from < steps:
        raise SystemExit(f"--failures-from must be in [0, {steps})")
    span = (steps - args.failures_from) / args.failures
    failures = [(args.failures_from + int((k + 0.5) * span)) // every * every + every // 2
                for k in range(args.failures)]
    work = make(0)

    def reference(seed):
        if args.references:
            with open(args.references) as f:
                r = json.load(f)["references"][seed]
            # JSON keys are strings; the runs index their steps by int
            return {**r, "losses": {int(k): v for k, v in r["losses"].items()},
                    "curve": {int(k): v for k, v in r["curve"].items()}}
        path = args.cache and os.path.join(args.cache, f"{work.name}-{seed}-{steps}-{every}.pkl")
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                return pickle.load(f)
        r = ft.reference(work if seed == 0 else make(seed), steps, every)
        if path:
            os.makedirs(args.cache, exist_ok=True)
            with open(path, "wb") as f:
                pickle.dump(r, f)
        return r

    refs = [reference(s) for s in range(3)]
    ref = refs[0]

    def degradation(q):
        base = ref["quality"]
        m = (base[0] - q[0]) / base[0] if work.higher else (q[0] - base[0]) / base[0]
        return m, (q[1] - base[1]) / base[1]

    noise = max(abs(degradation(r["quality"])[0]) for r in refs[1:])
    others = ", ".join(f"{r['quality'][0]:.4f}" for r in refs[1:])
    print(f"reference {work.metric} {ref['quality'][0]:.4f}; seeds 1, 2: {others}; noise floor {noise:.2%}",
          flush=True)
    rows = {}
    for path in args.merge or []:
        with open(path) as f:
            rows.update(json.load(f)["rows"])
    renames = {old: new for old, _, new in (item.partition("=>") for item in args.rename)}
    missing = [old for old, new in renames.items() if old not in rows or not new]
    if missing:
        raise SystemExit(f"--rename: no row {missing[0]!r} among {sorted(rows)} (or no new name)")
    rows = {renames.get(name, name): r for name, r in rows.items()}
    for name in [] if args.merge else args.methods:
        r = ft.run(method(name), work, steps, every, failures)
        r["degradation"] = degradation(r["quality"])
        r["spike"] = sum(r["after"].values()) / sum(ref["losses"][int(k)] for k in r["after"]) - 1
        rows[name] = r
        print(f"{name}: {work.metric} {r['quality'][0]:.4f} ({r['degradation'][0]:+.2%}; noise {noise:.2%}), params "
              f"{r['params_ratio']:.1f}x, whole {r['whole_ratio']:.1f}x, {r['seconds']:.0f} s", flush=True)
        if args.out:  # after every method: a long run stopped early keeps what it measured (--merge reads it)
            with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                json.dump(dict(command=f"python benchmarks/bench_fidelity.py {' '.join(sys.argv[1:])}",
                               failures=failures, noise=noise, references=refs, rows=rows), f, default=str)

    cmd = f"python benchmarks/bench_fidelity.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    if args.merge:
        cmd += " (figures of: " + "; ".join(json.load(open(p))["command"] for p in args.merge) + ")"
    lines = [f"# Fidelity ({work.name}): final quality after {args.failures} restores, against the noise floor", "",
             f"Command: `{cmd}`", "",
             f"{work.describe(steps)}. A checkpoint every {every} steps; failures after steps "
             f"{', '.join(map(str, failures))}, each resumed by a new manager and handler from the latest "
             "checkpoint. inshrink_jax keeps 3 steps; baselines keep every step.", "",
             f"Uninterrupted references (no checkpoints): seed 0 {work.metric} **{ref['quality'][0]:.4f}**, seeds 1 "
             f"and 2 {others}: noise floor **{noise:.2%}** (the "
             "largest |relative difference| from seed 0).", "",
             "Ratios: raw bytes / stored bytes summed over every save (params: parameter segments, baselines: the "
             "params item; whole: raw parameters + optimizer state + step against every byte written). "
             "Degradation: relative to seed 0, + is worse. Training loss after resumes: mean training loss of the "
             f"{ft.RESUME_WINDOW} steps after each resume against seed 0's on the same batches (paired: far less "
             "noisy than the final quality).", "",
             f"| method | params ratio | whole ratio | final {work.metric} | degradation | within noise | "
             "training loss after resumes | bytes written | restore s (all) | overhead blocking | run s |",
             "|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        d = r["degradation"][0]
        lines.append(f"| {name} | {r['params_ratio']:.1f}x | **{r['whole_ratio']:.1f}x** | {r['quality'][0]:.4f} | "
                     f"**{d:+.2%}** | {'yes' if d <= noise else 'no'} | {spike(r)} | {r['written']:,d} | "
                     f"{r['restore_s']:.1f} | {r['blocking'] / ref['seconds']:.1%} | {r['seconds']:.0f} |")
    ours = {n: r for n, r in rows.items() if n.startswith("inshrink")}
    base = {n: r for n, r in rows.items() if not n.startswith("inshrink")}
    if ours and base:
        lines += ["", "Against each baseline: the smallest inshrink_jax setting whose degradation is at most the "
                      "baseline's (or within noise), and how many times fewer bytes it wrote.", "",
                  "| baseline | its degradation | its bytes | inshrink_jax setting | its degradation | times fewer bytes |",
                  "|---|---:|---:|---|---:|---:|"]
        for n, b in base.items():
            bound = max(b["degradation"][0], noise)
            fits = [(r["written"], m) for m, r in ours.items() if r["degradation"][0] <= bound]
            if fits:
                w, m = min(fits)
                lines.append(f"| {n} | {b['degradation'][0]:+.2%} | {b['written']:,d} | {m} | "
                             f"{ours[m]['degradation'][0]:+.2%} | {b['written'] / w:.1f}x |")
            else:
                lines.append(f"| {n} | {b['degradation'][0]:+.2%} | {b['written']:,d} | none at that quality | | |")
    png = frontier_plot(rows, noise, work, os.path.splitext(args.out)[0] + ".png") if args.out else None
    if png:
        lines += ["", f"![bytes against degradation]({os.path.basename(png)})"]
    report.emit(lines, args.out)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(dict(command=cmd, failures=failures, noise=noise, references=refs, rows=rows), f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
