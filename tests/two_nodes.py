"""Two real nodes on one machine, for the multi-node tests: each a network namespace with its own address and
hostname (node0 and node1 on a veth pair, 10.231.0.1 and .2), and an /etc/hosts of its own that names both. A real
SLURM cluster spans them: slurmctld and one slurmd on node0, one slurmd on node1 (Debian's slurm-wlm and munge), with
spool, pid and log paths per node. Needs root; everything it makes is removed by stop().

    python tests/two_nodes.py   # start the cluster and print how to use it, until Ctrl-C
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_cluster import SLURM_CONF, job_tasks, start_munge, stop_daemons, wait_for_job
from support import user_environment

NODES = ("node0", "node1")
SUBNET = "10.231.0"


def address(node: str) -> str:
    return f"{SUBNET}.{NODES.index(node) + 1}"


class TwoNodes:
    def __init__(self, root: Path):
        self.root = root
        self.tag = f"cb{os.getpid() % 100000}"  # namespace and link names of this instance
        self.conf = root / "slurm.conf"
        self.daemons = []
        self.made = False

    def namespace(self, node: str) -> str:
        return f"{self.tag}n{NODES.index(node)}"

    def link(self, node: str) -> str:
        return f"{self.tag}v{NODES.index(node)}"

    def start(self):
        missing = [tool for tool in ["ip", "nsenter", "unshare"] if not shutil.which(tool)]
        if os.geteuid() != 0 or missing:
            raise RuntimeError(
                f"two nodes need root and ip, nsenter, unshare (uid {os.geteuid()}, missing "
                f"{missing}): apt-get install iproute2 util-linux"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        hosts = "127.0.0.1 localhost\n" + "".join(f"{address(node)} {node}\n" for node in NODES)
        (self.root / "hosts").write_text(hosts)
        self.made = True
        commands = [f"netns add {self.namespace(node)}" for node in NODES]
        commands += [f"link add {self.link('node0')} type veth peer name {self.link('node1')}"]
        for node in NODES:
            ns, link = self.namespace(node), self.link(node)
            commands += [
                f"link set {link} netns {ns}",
                f"-n {ns} addr add {address(node)}/24 dev {link}",
                f"-n {ns} link set {link} up",
                f"-n {ns} link set lo up",
            ]
        for command in commands:
            done = subprocess.run(["ip", *command.split()], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"ip {command}: {done.stderr.strip()}")
        return self

    def command_on(self, node: str, command: list) -> list:
        """command run on a node: in its network namespace, with its hostname and /etc/hosts (private mounts)."""
        setup = f'mount --bind {self.root / "hosts"} /etc/hosts && hostname {node} && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespace(node)}",
            "unshare",
            "--mount",
            "--uts",
            "sh",
            "-c",
            setup,
            "sh",
            *map(str, command),
        ]

    def popen(self, node: str, command: list, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command_on(node, command), **kwargs)

    def run(self, node: str, command: list, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command_on(node, command), **kwargs)

    def set_link(self, node: str, up: bool):
        """Take a node's link down (a network partition) or up again."""
        subprocess.run(
            ["ip", "-n", self.namespace(node), "link", "set", self.link(node), "up" if up else "down"], check=True
        )

    # SLURM over the two nodes.
    def start_slurm(self):
        missing = [tool for tool in ["sbatch", "slurmctld", "slurmd", "munged"] if not shutil.which(tool)]
        if missing:
            raise RuntimeError(
                f"SLURM is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm munge, as .ci/run does"
            )
        start_munge()
        (self.root / "state").mkdir(exist_ok=True)
        conf = SLURM_CONF.format(
            host=f"node0({address('node0')})", root=self.root, cpus=os.cpu_count(), ctld_port=6817, d_port=6818
        )
        conf = conf.replace(f"SlurmdSpoolDir={self.root}/spool", f"SlurmdSpoolDir={self.root}/spool-%n")
        conf = conf.replace("slurmd.pid", "slurmd-%n.pid").replace("slurmd.log", "slurmd-%n.log")
        node_line = next(line for line in conf.splitlines() if line.startswith("NodeName="))
        nodes = "\n".join(
            f"NodeName={node} NodeAddr={address(node)} CPUs={os.cpu_count()} State=UNKNOWN" for node in NODES
        )
        self.conf.write_text(conf.replace(node_line, nodes))
        self.env = user_environment(SLURM_CONF=str(self.conf))
        quiet = dict(env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.daemons = [self.popen("node0", ["slurmctld", "-D", "-f", self.conf], **quiet)]
        self.daemons += [self.popen(node, ["slurmd", "-D", "-N", node, "-f", self.conf], **quiet) for node in NODES]
        deadline = time.time() + 60
        while time.time() < deadline:
            state = self.slurm(["sinfo", "-h", "-o", "%T %D"])
            if state.stdout.split() in (["idle", "2"], ["mixed", "2"]):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the two SLURM nodes did not come up: {state.stdout} {state.stderr}\n{self.logs()}")

    def slurm(self, command: list, **kwargs) -> subprocess.CompletedProcess:
        """A SLURM client command (sinfo, sbatch, scontrol, ...) on node0, where slurmctld listens."""
        return self.run("node0", command, env=kwargs.pop("env", self.env), capture_output=True, text=True, **kwargs)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()}" for path in self.root.glob("*.log"))

    def job_state(self, job_id: str) -> list:
        return job_tasks(self.slurm(["scontrol", "-o", "show", "job", job_id]).stdout)

    def wait(self, job_id: str, timeout: float) -> list:
        return wait_for_job(self.job_state, job_id, timeout)

    def stop(self):
        stop_daemons(self.daemons)
        if self.made:
            for node in NODES:  # deleting a namespace deletes its end of the veth pair, and the pair with it
                subprocess.run(["ip", "netns", "delete", self.namespace(node)], capture_output=True)


if __name__ == "__main__":
    import tempfile

    cluster = TwoNodes(Path(tempfile.mkdtemp(prefix="two-nodes-")))
    try:
        cluster.start().start_slurm()
        print(
            f"two nodes up: node0 {address('node0')}, node1 {address('node1')}; SLURM_CONF={cluster.conf}\n"
            f"  run on a node:  nsenter --net=/run/netns/{cluster.namespace('node0')} <command>\n"
            f"  a 2-node job:   SLURM_CONF={cluster.conf} nsenter --net=/run/netns/{cluster.namespace('node0')} "
            "srun -N2 hostname\nCtrl-C stops and removes it.",
            flush=True,
        )
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
    finally:
        cluster.stop()
        sys.exit(0)
