"""The size table of README.md in this folder: python docs/benchmarks/2026-12-06-script-size/measure.py FILE...
(from the repository's root). The figures are tests/test_code.py's script_size, with the mean non-blank line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_code import script_size

print("| file | lines | mean non-blank line | non-whitespace chars | comments + docstrings | lines over 100 cols |")
print("|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    text = Path(path).read_text()
    nonblank = [line for line in text.splitlines() if line.strip()]
    size = script_size(text)
    cells = [Path(path).name, size["lines"], f"{sum(map(len, nonblank)) / len(nonblank):.0f}"]
    cells += [f"{size['characters'] / 1000:.1f}k", f"{size['prose']:.0%}", size["wide_lines"]]
    print("| " + " | ".join(map(str, cells)) + " |")
