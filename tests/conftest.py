"""The suite's fixtures and pytest hooks. What the tests share (running a script, reading its logs) is in support.py,
imported here first: importing it sets the environment every test runs in (the CPU platform, XLA_FLAGS)."""

import os

import pytest
import support  # first: its environment, set at import

# The test files, the longest first: pytest-xdist hands whole files to its two workers in this order (pyproject.toml),
# so the last ones to start are short. Files not named follow. Their times on CI's machine:
# docs/benchmarks/2026-12-04-ci-time.
LONGEST_FIRST = [
    "test_exact.py",
    "test_memory.py",
    "test_gpu_compile.py",
    "test_training.py",
    "test_two_nodes.py",
    "test_reliability.py",
    "test_distributed.py",
    "test_check_fork.py",
    "test_evaluate.py",
    "test_benchmark.py",
    "test_env_registry.py",
    "test_continuous.py",
    "test_ppo_update.py",
    "test_forks.py",
]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_runtest_setup(item):
    """A test marked needs_root("what for") is skipped, in one line, where this process is not root; under CI=true it
    runs, and fails on what it lacks."""
    marker = item.get_closest_marker("needs_root")
    if marker is not None and os.geteuid() != 0 and not support.IN_CI:
        pytest.skip(f"needs root: {', '.join(marker.args) or 'see the test'}")


@pytest.fixture(autouse=True)
def xla_optimization(request):
    """Whether the test's script runs compile with XLA's defaults (marked xla_default) or LLVM_UNOPTIMIZED."""
    support.xla_default[0] = request.node.get_closest_marker("xla_default") is not None


@pytest.fixture(params=["ppo", "impala"])
def script(request):
    return request.param
