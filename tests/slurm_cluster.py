"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd from Debian's slurm-wlm and
munge packages (.ci/run installs them), configured in a temporary directory and stopped afterwards."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from support import free_port, user_environment

SLURM_CONF = """\
ClusterName=cleanba-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits this long (the job credential's lifetime) before it starts again; SLURM's default is 120 s.
AuthInfo=cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A job that becomes eligible with time alone (a requeued one, once its credential expired) waits for the main
# scheduler's periodic pass: every 2 s here, against SLURM's default of 60 s.
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def munge_works() -> bool:
    if not shutil.which("munge"):
        return False
    encoded = subprocess.run(["munge", "-n"], capture_output=True)
    return (
        encoded.returncode == 0
        and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True).returncode == 0
    )


def start_munge():
    """munged, unless one already answers: its socket is a file, so one serves every network namespace too."""
    if munge_works():
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    for _ in range(50):
        if munge_works():
            return
        time.sleep(0.1)


def job_tasks(scontrol_output: str) -> list:
    """Fields of `scontrol -o show job` for every task of a job (array tasks included)."""
    return [
        dict(field.split("=", 1) for field in line.split() if "=" in field) for line in scontrol_output.splitlines()
    ]


ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")


def wait_for_job(job_state, job_id: str, timeout: float) -> list:
    """The job's tasks (job_state(job_id)) once none is active."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        tasks = job_state(job_id)
        if tasks and all(task["JobState"] not in ACTIVE for task in tasks):
            return tasks
        time.sleep(1)
    raise TimeoutError(f"job {job_id} did not finish in {timeout} s: {job_state(job_id)}")


def stop_daemons(daemons: list):
    for daemon in daemons:
        daemon.terminate()
    for daemon in daemons:
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = user_environment(SLURM_CONF=str(self.conf))
        self.daemons = []

    def start(self):
        missing = [tool for tool in ["sbatch", "slurmctld", "slurmd", "munged"] if not shutil.which(tool)]
        if missing:
            raise RuntimeError(
                f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge, as .ci/run does"
            )
        start_munge()
        for directory in ["state", "spool"]:
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(
            SLURM_CONF.format(host=host, root=self.root, cpus=os.cpu_count(), ctld_port=free_port(), d_port=free_port())
        )
        self.daemons = [
            subprocess.Popen(
                [daemon, "-D", "-f", str(self.conf)], env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            for daemon in ["slurmctld", "slurmd"]
        ]
        deadline = time.time() + 60
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if state.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not come up: {state.stdout} {state.stderr}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(path.read_text() for path in self.root.glob("*.log"))

    def job_state(self, job_id: str) -> list:
        return job_tasks(
            subprocess.run(
                ["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True, text=True
            ).stdout
        )

    def wait(self, job_id: str, timeout: float) -> list:
        return wait_for_job(self.job_state, job_id, timeout)

    def stop(self):
        stop_daemons(self.daemons)
