"""Shared by the benchmark scripts: print a markdown result table and optionally keep it in a file."""


def emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    print(text, end="")
