"""The docs cannot drift: every command shown in README.md and docs/*.md that runs a training script or a
`python -m cleanba.X` module names only flags it has, every such module exists and answers --help, and every
relative link or image resolves, to a heading where it names one (#anchor)."""

import functools
import re
import shlex
import subprocess
import sys
from dataclasses import fields

import pytest
from support import ROOT, script_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"^cleanba/(cleanba_\w+)\.py$")


def code_texts(text: str) -> list:
    """The fenced code blocks (backslash continuations joined) and the inline code spans of a markdown text."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()] + inline


def commands(text: str) -> list:
    """(target, flags) of each command in the code: target a script's module name ("cleanba_ppo") or a module
    ("cleanba.evaluate"); flags the --options given to it (up to a bare "--", after which they are another's)."""
    found = []
    for code in code_texts(text):
        for part in re.split(r"&&|;|\|", code.split("#")[0]):
            try:
                tokens = shlex.split(part)
            except ValueError:
                tokens = part.split()
            for i, token in enumerate(tokens):
                script = SCRIPT.match(token)
                module = token if i and tokens[i - 1] == "-m" and token.startswith("cleanba.") else None
                if script or module:
                    rest = tokens[i + 1 :]
                    rest = rest[: rest.index("--")] if "--" in rest else rest
                    found.append(
                        (script.group(1) if script else module, [t.split("=")[0] for t in rest if t.startswith("--")])
                    )
                    break
    return found


@functools.cache
def script_flags(name: str) -> set:
    import importlib

    module = importlib.import_module(f"cleanba.{name}")
    names = {f"--{f.name.replace('_', '-')}" for f in fields(module.Args)}
    return names | {f"--no-{n[2:]}" for n in names} | {"--help"}


def module_source(module: str):
    """The file that holds a `python -m cleanba.X` module's docstring: cleanba/X.py, or a package's __init__.py."""
    path = ROOT / "cleanba" / module.split(".", 1)[1].replace(".", "/")
    return path / "__init__.py" if (path / "__main__.py").is_file() else path.with_suffix(".py")


@functools.cache
def module_help(module: str) -> tuple:
    """(exit status, output) of `python -m module --help`."""
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_commands_name_only_real_flags(page):
    shown = commands(page.read_text())
    for target, flags in shown:
        if target.startswith("cleanba."):
            assert module_source(target).is_file(), f"{page.name}: no module {target}"
            status, output = module_help(target)
            assert status == 0, f"{page.name}: python -m {target} --help failed:\n{output}"
            known = set(re.findall(r"--[a-z][a-z0-9-]*", output))
        else:
            known = script_flags(target)
        unknown = sorted(set(flags) - known)
        assert not unknown, f"{page.name}: {target} has no flag {unknown}"


def test_the_pages_show_the_commands_users_type():
    """The check above sees the commands: the README's train command, a layout and a module command at least."""
    shown = commands((ROOT / "README.md").read_text())
    assert ("cleanba_ppo", ["--actor-device-ids", "--learner-device-ids"]) in shown
    assert any(target == "cleanba.launch_slurm" and "--ntasks-per-node" in flags for target, flags in shown)


def anchors(page) -> set:
    """The anchors GitHub gives a markdown page's headings: lower case, punctuation dropped, spaces as hyphens, and
    -1, -2, ... after a repeated one."""
    seen, found = {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


REPORTS = sorted((ROOT / "docs" / "benchmarks").glob("*/README.md"))  # the dated measurement reports


@pytest.mark.parametrize("page", PAGES + REPORTS, ids=[str(p.relative_to(ROOT)) for p in PAGES + REPORTS])
def test_relative_links_and_images_resolve(page):
    """Every relative link reaches a file, and its #anchor, if any, a heading of that file."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        assert linked.exists(), f"{page.name}: {target} does not resolve"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: {target}: no heading of {linked.name} has that anchor"


TOOLS = ["evaluate", "score_report", "compare_layouts", "launch_slurm", "benchmark", "gpu_compile"]


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tools_help_gives_its_usage_and_an_example(tool):
    """`python -m cleanba.TOOL --help`: the command as typed, and the examples of the tool's docstring."""
    process = subprocess.run(
        [sys.executable, "-m", f"cleanba.{tool}", "--help"],
        cwd=ROOT,
        env=dict(script_env(), COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.startswith(f"usage: python -m cleanba.{tool} "), process.stdout[:200]
    source = module_source(f"cleanba.{tool}").read_text()
    docstring = source.split('"""')[1].replace("\\\\", "\\")  # a backslash as the source escapes it
    examples = [line.strip() for line in docstring.splitlines() if line.startswith(f"    python -m cleanba.{tool} ")]
    assert examples and all(example in process.stdout for example in examples), examples
