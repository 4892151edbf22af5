"""The training scripts share one engine: their ENGINE blocks are the same in all, byte for byte, so that `diff` of
any two shows only the algorithm and an engine fix is one block copied. The engine calls the algorithm only through
the hooks listed here, which every script gathers in one marked block; code that two scripts' algorithms both hold
under one name is the same in both unless it is the algorithm's own; types are defined before their use and the run
comes last; and the names the tools use of a script imported as a module exist in every script."""

import ast
import difflib
import importlib
import io
import re
import tokenize

import pytest
from support import ROOT, SCRIPTS

from cleanba.check_fork import split

TOOLS = [
    "evaluate.py",
    "gpu_compile.py",
    "benchmark/__main__.py",
    "benchmark/common.py",
    "benchmark/phases.py",
    "benchmark/layers.py",
]
# The hooks: what the engine calls of the algorithm, and what a fork must keep (docs/forking.md).
HOOKS = (
    "ACTION_SPACE",
    "MICRO_BATCHES_SPLIT",
    "minibatch_env_sets",
    "check_algorithm",
    "make_network",
    "replay_fields",
    "recurrent_state_size",
    "policy_step",
    "sample_actions",
    "env_actions",
    "make_optimizer",
    "learn",
)
HOOKS_MARKER = "# ---- The hooks the engine calls"
# Names that scripts' algorithms define each their own way: the flags, the network and the loss of each algorithm,
# and the minibatch step (PPO's takes time steps of every env, IMPALA's whole sequences of an env set).
OWN = {"Args", "Agent", "update_minibatch", "ppo_loss", *HOOKS}


def text(script: str) -> str:
    return SCRIPTS[script].read_text()


@pytest.mark.parametrize("script", [name for name in SCRIPTS if name != "ppo"])
def test_the_engine_blocks_are_byte_identical_in_every_script(script):
    ppo, other = split(text("ppo"))[1], split(text(script))[1]
    names = SCRIPTS["ppo"].name, SCRIPTS[script].name
    diff = "".join(difflib.unified_diff(ppo.splitlines(True), other.splitlines(True), *names))
    assert ppo == other, f"the ENGINE blocks differ; copy the changed block to the other:\n{diff}"


def references(code: str) -> tuple:
    """(names read, names called) by Python code, from its syntax tree: a word in a string or a comment, an
    attribute (x.learn), a keyword argument or an assignment is not a use of a module-level name."""
    tree = ast.parse(code)
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return read, called


def top_level_definitions(code: str) -> dict:
    """{name: source} of the functions, classes and constants a script defines at module level."""
    found = {}
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            found[node.name] = ast.get_source_segment(code, node)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = ast.get_source_segment(code, node)
    return found


def engine_code(script: str) -> str:
    """The ENGINE blocks as code: the first one starts inside the class Args, so it is dedented to parse."""
    engine = split(text(script))[1]
    first, rest = re.match(r"((?:[ \t]+.*\n|\n)*)(.*)", engine, re.S).groups()
    return "class Args:\n" + first + rest


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_engine_reaches_the_algorithm_only_through_the_hooks(script):
    """HOOKS is exactly what the engine's code uses of the algorithm (besides Args, the flags): each hook is defined
    by the script and used by the engine, and nothing else the algorithm defines is."""
    defined = top_level_definitions(text(script))
    algorithm_names = set(defined) - set(top_level_definitions(engine_code(script)))
    missing = sorted(set(HOOKS) - algorithm_names)
    assert not missing, f"{SCRIPTS[script].name} does not define the hooks {missing} outside its ENGINE blocks"
    read, called = references(engine_code(script))
    used = sorted(name for name in algorithm_names & (read | called) if name not in (*HOOKS, "Args"))
    assert not used, f"the engine uses {used} of the algorithm, which are not hooks (HOOKS)"
    unused = sorted(set(HOOKS) - read - called)
    assert not unused, f"HOOKS lists {unused}, which the engine's code does not use"


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_hooks_are_one_marked_block_with_a_line_each(script):
    """After the marker line, before the next ENGINE block: every hook, each function with its docstring and each
    constant with its comment, and nothing but hooks."""
    source = text(script)
    assert source.count(HOOKS_MARKER) == 1, f"{SCRIPTS[script].name}: one '{HOOKS_MARKER}' line expected"
    block = source[source.index(HOOKS_MARKER) :]
    block = block[: block.index("# ======== ENGINE:")]
    definitions = top_level_definitions(block)
    assert sorted(definitions) == sorted(HOOKS), f"the hooks block holds {sorted(definitions)}, not {sorted(HOOKS)}"
    for name, code in definitions.items():
        if code.startswith("def "):
            assert ast.get_docstring(ast.parse(code).body[0]), f"hook {name} has no docstring"
        else:
            line = next(line for line in block.splitlines() if line.startswith(f"{name} ="))
            assert "  # " in line, f"hook {name} has no comment on its line"


def test_code_two_algorithms_hold_under_one_name_is_the_same():
    """A function or class that several scripts define outside their ENGINE blocks (the ResNet, GAE, the minibatch
    shuffles, the value pass) is a copy kept on purpose: any difference is drift, unless the name is in OWN."""
    definitions = {script: top_level_definitions(split(text(script))[0]) for script in SCRIPTS}
    for name in sorted({name for found in definitions.values() for name in found} - OWN):
        copies = {script: found[name] for script, found in definitions.items() if name in found}
        first, *others = copies
        for other in others:
            diff = "".join(difflib.unified_diff(copies[first].splitlines(True), copies[other].splitlines(True)))
            assert copies[first] == copies[other], (
                f"{name} differs in cleanba_{first}.py and cleanba_{other}.py:\n{diff}"
            )


def name_positions(source: str, name: str) -> list:
    """The lines where source's code (not its comments or docstrings) names `name`, as a name or a quoted type."""
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if (token.type == tokenize.NAME and token.string == name) or (
            token.type == tokenize.STRING and token.string.strip("\"'") == name
        ):
            lines.append(token.start[0])
    return lines


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_types_come_before_their_use_and_the_run_last(script):
    """Every class a script defines is named by no line above its definition (an annotation, a quoted type or
    code), and the script ends with the run: start, train, main."""
    source = text(script)
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            early = [line for line in name_positions(source, node.name) if line < node.lineno]
            assert not early, f"{node.name} is used on lines {early}, before its definition on line {node.lineno}"
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions[-4:] == ["start", "send_params_for_rollout", "train", "main"], functions[-4:]


def test_the_names_tools_use_exist_in_every_script():
    used = set()
    for tool in TOOLS:
        used |= set(re.findall(r"\bmodule\.([A-Za-z]\w*)", (ROOT / "cleanba" / tool).read_text()))
    assert {"Args", "make_network", "make_actor_threads"} <= used, "the tools' uses of a script were not found"
    for script in SCRIPTS:
        module = importlib.import_module(f"cleanba.cleanba_{script}")
        missing = sorted(name for name in used if not hasattr(module, name))
        assert not missing, f"the tools use {missing} of a script, which cleanba_{script}.py does not define"
