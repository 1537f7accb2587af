"""The scaffolding the two training-loop examples share, kept out of them so they show only the library's use:
their command line, the per-save line they print, and the simulated crash."""

from __future__ import annotations

import argparse
import os

from inshrink_jax.cli import describe_choice


def parse_args(doc: str, argv=None) -> argparse.Namespace:
    """--dir (a CheckpointManager root), --steps, --every (checkpoint interval), --crash-at."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--dir", required=True, help="checkpoint directory (a CheckpointManager root)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--crash-at", type=int, default=None, help="end the process abruptly after this step")
    return ap.parse_args(argv)


def report_save(mngr, step: int, loss) -> None:
    """Wait for the save of `step` (only to print its figures; training does not need to) and print them."""
    mngr.wait_until_finished()
    report_figures(step, loss, mngr.item_metadata(step))


def report_figures(step: int, loss, f) -> None:
    """Print a save's figures (`records.Figures`)."""
    q = f["search"]["chosen"]
    chosen = describe_choice(q)
    print(f"step {step}: loss {float(loss):.4f}; checkpoint {f['kind']}, {chosen}, params "
          f"{f['ratio']['params']:.1f}x, whole {f['ratio']['total']:.1f}x smaller")


def maybe_crash(step: int, crash_at: int | None) -> None:
    """End the process after step `crash_at`: no cleanup, no waiting, like a killed process."""
    if step == crash_at:
        print(f"simulated crash after step {step}", flush=True)
        os._exit(1)
