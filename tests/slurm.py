"""A single-node SLURM on this machine for the tests: munged, slurmctld and slurmd on localhost.

Debian's ``slurm-wlm`` and ``munge`` packages (``make slurm`` installs them). Everything lives in
one folder: the munge key and socket, ``slurm.conf``, the controller's state, the daemons' logs.
The settings a container needs: process tracking by parent process (``proctrack/linuxproc``, no
cgroups), no task binding (``task/none``), no accounting storage (so no ``sacct``: lmc reads job
states with ``squeue``), root as the SLURM user, ports picked free on localhost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: The daemons and commands the cluster needs.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


def missing_binaries() -> list[str]:
    """The daemons and commands not on ``PATH`` (``make slurm`` installs them)."""
    return [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).is_file()]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class Cluster:
    """A running single-node cluster: ``env`` holds ``SLURM_CONF`` for its commands."""

    folder: Path
    env: dict[str, str]

    def command(self, *args: str, check: bool = True) -> str:
        """Run a SLURM command (``squeue``, ``scontrol``, ...) on this cluster; returns its output."""
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def state(self, job_id: str) -> str:
        """The job's state as squeue has it (``""`` once squeue no longer knows it)."""
        return self.command("squeue", "--noheader", "--states=all", "--format=%T", "--jobs", job_id).strip()

    def requeue(self, job_id: str, timeout: float = 60.0) -> None:
        """Requeue a running job as a preemption does (SLURM kills it and queues it again), and let it
        start again at once instead of after SLURM's requeue delay."""
        self.command("scontrol", "requeue", job_id)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state == "RUNNING" and "Restarts=1" in self.command("scontrol", "show", "job", job_id):
                return
            if state == "PENDING":
                self.command("scontrol", "update", f"jobid={job_id}", "StartTime=now", check=False)
            time.sleep(0.5)
        raise RuntimeError(f"job {job_id} did not start again within {timeout} s of its requeue: {self.logs()}")

    def requeue_when_paused(self, marker: Path, timeout: float = 150.0) -> tuple[threading.Thread, list[str]]:
        """A started thread that requeues the job ``marker`` names once it is written (a fit paused by
        tests/interruptions.py's ``PauseOnce``), and the list it puts that job's id in; nothing if
        ``marker`` is not written within ``timeout`` seconds."""
        requeued: list[str] = []

        def requeue() -> None:
            deadline = time.monotonic() + timeout
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if marker.exists():
                job = json.loads(marker.read_text())["slurm_job_id"]
                self.requeue(job)
                requeued.append(job)

        thread = threading.Thread(target=requeue)
        thread.start()
        return thread, requeued

    def logs(self) -> str:
        """The last lines of the daemons' logs, for a failure message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.folder / "log" / name
            if path.is_file():
                parts.append(f"{name}: " + " | ".join(path.read_text().splitlines()[-5:]))
        return "; ".join(parts)


def _config(folder: Path, munge_socket: Path) -> str:
    cpus = os.cpu_count() or 1
    return f"""ClusterName=lmctest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
KillWait=2
MinJobAge=600
NodeName=localhost NodeHostname={socket.gethostname()} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def start(folder: Path, timeout: float = 60.0) -> Cluster:
    """Start munged, slurmctld and slurmd with everything under ``folder``; returns when the node is idle."""
    for name in ("munge", "state", "spool", "log"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    munge = folder / "munge"
    munge.chmod(0o711)  # munged refuses a socket folder others cannot enter
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_socket = munge / "munge.socket"
    subprocess.run(
        [
            _binary("munged"), f"--key-file={key}", f"--socket={munge_socket}", f"--pid-file={munge}/munged.pid",
            f"--log-file={folder}/log/munged.log", f"--seed-file={munge}/seed", "--force",
        ],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, munge_socket))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run([_binary("slurmctld"), "-f", str(conf)], env=env, check=True, capture_output=True, timeout=30)
    subprocess.run([_binary("slurmd"), "-f", str(conf)], env=env, check=True, capture_output=True, timeout=30)
    cluster = Cluster(folder, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(["sinfo", "--noheader", "--format=%T"], env=env, capture_output=True, text=True)
        if listed.stdout.strip() == "idle":
            return cluster
        time.sleep(0.5)
    stop(cluster)
    raise RuntimeError(f"the SLURM node did not come up within {timeout} s: {cluster.logs()}")


def stop(cluster: Cluster) -> None:
    """Stop the daemons this cluster started (by their pid files), the jobs with them."""
    subprocess.run(["scancel", "--user", "root"], env=cluster.env, capture_output=True, timeout=30)
    for name in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
        path = cluster.folder / name
        if not path.is_file():
            continue
        pid = int(path.read_text().split()[0])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
