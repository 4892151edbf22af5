"""Code habits: ruff's lint rules and its formatter (pyproject.toml) pass, no module under cleanba/ imports another
that imports it back, directly or through others (imports inside functions count too), and each training script
stays the size of the files it is modelled on."""

import ast
import io
import re
import subprocess
import sys
import tokenize

import pytest
from support import ROOT, SCRIPTS


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ruff_lint_passes():
    result = ruff("check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_fork_passes_the_lint_wherever_it_lies(script, tmp_path):
    """A copy of a training script under another name (docs/forking.md: `cp cleanba/cleanba_ppo.py
    cleanba/my_ppo.py`), checked with the project's ruff configuration: the scripts' one lint exception (their
    imports after prepare_process) is in the file, not in pyproject.toml's list of paths."""
    fork = tmp_path / f"my_{script}.py"
    fork.write_text(SCRIPTS[script].read_text())
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(fork)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_passes():
    result = ruff("format", "--check")
    assert result.returncode == 0, f"run `ruff format .`:\n{result.stdout}{result.stderr}"


def test_every_test_reads_ci_one_way():
    """CI=true (set by .ci/run, documented in docs/tests.md) turns the skips of missing tools into failures: every
    test reads it the same way, so that one value of CI does not fail some of them and skip others."""
    readings = set()
    for path in (ROOT / "tests").glob("*.py"):
        readings |= {
            (path.name, match) for match in re.findall(r"""environ(?:\.get\(|\[)["']CI["'].{0,12}""", path.read_text())
        }
    odd = sorted(
        (name, match)
        for name, match in readings
        if not re.fullmatch(r"""environ\.get\(["']CI["']\) == "true".*""", match)
    )
    assert not odd, f'read CI as os.environ.get("CI") == "true": {odd}'


def module_name(path) -> str:
    """A file's module under cleanba/, dotted ("flags", "benchmark.common"); a package's __init__.py is the package."""
    parts = path.relative_to(ROOT / "cleanba").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cleanba_imports(path, modules: set) -> set:
    """The cleanba modules a file imports, anywhere in it, with the packages that importing them runs first
    (cleanba.benchmark.common runs cleanba/benchmark/__init__.py). modules: the names of all of them."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cleanba":
            base = node.module.removeprefix("cleanba").lstrip(".")
            for alias in node.names:  # from cleanba.benchmark import phases: a module; from cleanba.flags import fail
                name = f"{base}.{alias.name}".lstrip(".")
                found.add(name if name in modules else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("cleanba.") for alias in node.names if alias.name.startswith("cleanba.")}
    found.discard("")
    return found | {name.rsplit(".", i)[0] for name in found for i in range(1, name.count(".") + 1)}


def test_no_import_cycle_between_cleanba_modules():
    paths = sorted((ROOT / "cleanba").rglob("*.py"))  # the helpers, scripts and commands, the benchmark package's too
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): cleanba_imports(path, modules) for path in paths}
    assert {"flags", "benchmark", "benchmark.common", "benchmark.__main__"} <= set(graph), sorted(graph)
    assert {"benchmark", "benchmark.common", "benchmark.phases"} <= graph["benchmark.__main__"], "imports not read"

    def cycle_from(module, path):
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                return [*path[path.index(imported) :], imported]
            found = cycle_from(imported, [*path, imported])
            if found:
                return found
        return None

    for module in sorted(graph):
        cycle = cycle_from(module, [module])
        assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


# A training script's size beside the files it is modelled on (the original Cleanba's PPO: 801 lines, 25.1k
# characters, 12% prose, 38 lines over 100 columns; docs/benchmarks/2026-12-06-script-size): about 800 lines and 30k
# characters besides whitespace, about a quarter of them comments and docstrings, about 40 lines over 100 columns.
SIZE_BOUNDS = dict(lines=820, characters=32_000, prose=0.26, wide_lines=40)


def script_size(text: str) -> dict:
    """Lines, characters besides whitespace, the share of those in comments and docstrings (module, class, function
    and field docstrings: every string that is a statement of its own), and lines over 100 columns."""
    lines = text.splitlines()
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
        characters=characters,
        prose=len("".join("".join(prose).split())) / characters,
        wide_lines=sum(len(line) > 100 for line in lines),
    )


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_a_training_script_is_the_size_of_its_models(script):
    size = script_size(SCRIPTS[script].read_text())
    over = {name: f"{size[name]:.4g} > {bound}" for name, bound in SIZE_BOUNDS.items() if size[name] > bound}
    assert not over, f"{SCRIPTS[script].name} is past its size: {over}; cut prose that is not a reason or a source"
