"""cleanba/family.py, the training scripts' registry: it names every training script in cleanba/, with the action
space each one says it trains, so that the tools and tests that read it miss none."""

import re

from support import ROOT

from cleanba.family import FAMILY, SCRIPTS


def test_every_training_script_is_registered():
    on_disk = {path.name for path in (ROOT / "cleanba").glob("cleanba_*.py")}
    assert {path.name for path in SCRIPTS.values()} == on_disk
    assert all(path.parent == ROOT / "cleanba" and path.is_file() for path in SCRIPTS.values())
    assert all(path.stem == f"cleanba_{name}" for name, path in SCRIPTS.items())  # the name the tools take


def test_each_scripts_action_space_is_the_one_it_declares():
    for name, script in FAMILY.items():
        (declared,) = re.findall(r'^ACTION_SPACE = "(\w+)"', script.path.read_text(), re.M)
        assert script.action_space == declared, name
