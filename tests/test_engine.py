"""The training scripts share one engine: the text below the ENGINE line is the same in all, byte for byte, so that
`diff` of any two shows only the algorithm and an engine fix is one block copied. The engine calls the algorithm above
the line only through the names listed here, and the names the tools use of a script imported as a module exist in
every script."""

import ast
import difflib
import importlib
import re

import pytest
from conftest import ROOT, SCRIPTS

MARKER = "# ======== ENGINE:"
TOOLS = [
    "evaluate.py",
    "gpu_compile.py",
    "benchmark/__main__.py",
    "benchmark/common.py",
    "benchmark/phases.py",
    "benchmark/layers.py",
]
# The algorithm as the engine calls it: what a fork must keep (docs/forking.md).
ALGORITHM_NAMES = (
    "CommonFlags",
    "Algorithm",
    "check_algorithm",
    "ACTION_SPACE",
    "MICRO_BATCHES_SPLIT",
    "minibatch_env_sets",
    "make_network",
    "recurrent_state_size",
    "policy_step",
    "sample_actions",
    "env_actions",
    "learn",
    "make_optimizer",
)


def parts(script: str) -> tuple:
    """(top: after the module docstring up to the algorithm, i.e. the imports; the algorithm, from the first flags
    (CommonFlags: what to train by default differs by script) on; the engine) of a script's text."""
    text = SCRIPTS[script].read_text()
    assert text.count(MARKER) == 1, f"{SCRIPTS[script].name}: one ENGINE line expected"
    docstring_end = text.index('"""', 3) + 3
    algorithm, engine = text.index("@dataclass\nclass CommonFlags"), text.index(MARKER)
    return text[docstring_end:algorithm], text[algorithm:engine], text[engine:]


@pytest.mark.parametrize("script", [name for name in SCRIPTS if name != "ppo"])
@pytest.mark.parametrize("part", [0, 2], ids=["top", "engine"])
def test_the_shared_parts_are_byte_identical_in_every_script(part, script):
    ppo, other = parts("ppo")[part], parts(script)[part]
    names = SCRIPTS["ppo"].name, SCRIPTS[script].name
    diff = "".join(difflib.unified_diff(ppo.splitlines(True), other.splitlines(True), *names))
    assert ppo == other, f"the scripts differ outside the algorithm; copy the changed block to the other:\n{diff}"


def references(code: str) -> tuple:
    """(names read, names called) by Python code, from its syntax tree: a word in a string or a comment, an
    attribute (x.learn), a keyword argument or an assignment is not a use of a module-level name."""
    tree = ast.parse(code)
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return read, called


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_engine_reaches_the_algorithm_only_through_its_listed_names(script):
    """ALGORITHM_NAMES is exactly what the engine's code uses of the algorithm: each listed name is defined above
    the line and used below it (a function called, a class or constant read), and nothing else defined above is
    used below."""
    _, top, engine = parts(script)
    for name in ALGORITHM_NAMES:
        assert re.search(rf"^(def |class |){name}\b", top, re.M), f"{name} is not defined above the ENGINE line"
    functions = set(re.findall(r"^def (\w+)", top, re.M))
    defined_above = set(re.findall(r"^(?:def|class) (\w+)|^([A-Z_]+) =", top, re.M))
    defined_above = {a or b for a, b in defined_above}
    read, called = references(engine)
    used = sorted(name for name in defined_above & read if name not in ALGORITHM_NAMES)
    assert not used, f"the engine uses {used} of the algorithm without listing them in ALGORITHM_NAMES"
    unused = sorted(name for name in ALGORITHM_NAMES if name not in (called if name in functions else read))
    assert not unused, f"ALGORITHM_NAMES lists {unused}, which the engine's code does not call or read"


def test_the_names_tools_use_exist_in_both_scripts():
    used = set()
    for tool in TOOLS:
        used |= set(re.findall(r"\bmodule\.([A-Za-z]\w*)", (ROOT / "cleanba" / tool).read_text()))
    assert {"Args", "make_network", "make_actor_threads"} <= used, "the tools' uses of a script were not found"
    for script in SCRIPTS:
        module = importlib.import_module(f"cleanba.cleanba_{script}")
        missing = sorted(name for name in used if not hasattr(module, name))
        assert not missing, f"the tools use {missing} of a script, which cleanba_{script}.py does not define"
