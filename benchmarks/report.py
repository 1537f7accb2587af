"""Shared by the benchmark scripts: print a markdown result table and optionally keep it in a file; sizes of
files on disk; timings of repeated calls; a process's time and fresh memory."""

import os
import resource
import time

import jax


def emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text, end="")


def files(root: str) -> dict[str, int]:
    """{path: size} of every file under `root`."""
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs}


def dir_bytes(path: str) -> int:
    return sum(files(path).values())


def call_seconds(fn, repeats: int, warm_up: bool = True) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn` (its result blocked on, for JAX's async dispatch), after
    one untimed call if `warm_up` (compiles and first touches left out)."""
    if warm_up:
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def usage():
    """[wall seconds, user CPU seconds, system CPU seconds, fresh memory MB (minor page faults times the page
    size)] of this process so far, as an array: the difference of two readings is what happened between them."""
    import numpy as np
    r = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt * resource.getpagesize() / 1e6])
