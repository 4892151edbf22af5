"""The training scripts of the family, one line each: the tools that run or check a script by name (the benchmark,
check_fork), the refusal of an env whose actions a script does not train (spaces.check_env) and the tests read them
here. A new script is added by one line below."""

from pathlib import Path
from typing import NamedTuple

CLEANBA = Path(__file__).resolve().parent  # cleanba/, which holds the training scripts


class Script(NamedTuple):
    path: Path
    action_space: str  # the kind of action space it trains, its ACTION_SPACE: "Discrete" or "Box" (of floats)
    algorithm: str  # the name a model card gives it


FAMILY = {
    "ppo": Script(CLEANBA / "cleanba_ppo.py", "Discrete", "PPO"),
    "impala": Script(CLEANBA / "cleanba_impala.py", "Discrete", "IMPALA"),
    "ppo_continuous": Script(CLEANBA / "cleanba_ppo_continuous.py", "Box", "PPO"),
    "pqn": Script(CLEANBA / "cleanba_pqn.py", "Discrete", "PQN"),
    "sac": Script(CLEANBA / "cleanba_sac.py", "Box", "SAC"),
}
SCRIPTS = {name: script.path for name, script in FAMILY.items()}
