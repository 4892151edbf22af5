"""The size table of README.md in this folder: python measure.py FILE... (run from anywhere)."""

import ast
import io
import sys
import tokenize
from pathlib import Path


def measure(text: str) -> dict:
    lines = text.splitlines()
    nonblank = [line for line in lines if line.strip()]
    characters = len("".join(text.split()))
    prose = [
        token.string for token in tokenize.generate_tokens(io.StringIO(text).readline) if token.type == tokenize.COMMENT
    ]
    prose += [
        ast.get_source_segment(text, node)
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    return dict(
        lines=len(lines),
        mean=sum(map(len, nonblank)) / len(nonblank),
        characters=characters,
        prose=len("".join("".join(prose).split())) / characters,
        wide=sum(len(line) > 100 for line in lines),
    )


if __name__ == "__main__":
    print("| file | lines | mean non-blank line | non-whitespace chars | comments + docstrings | lines over 100 cols |")
    print("|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        m = measure(Path(path).read_text())
        cells = [Path(path).name, m["lines"], f"{m['mean']:.0f}", f"{m['characters'] / 1000:.1f}k"]
        cells += [f"{m['prose']:.0%}", m["wide"]]
        print("| " + " | ".join(map(str, cells)) + " |")
