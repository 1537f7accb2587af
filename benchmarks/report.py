"""Shared by the benchmark scripts: print a markdown result table and optionally keep it in a file; sizes of
files on disk."""

import os


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
