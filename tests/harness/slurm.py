"""A real Slurm on this host for a test: munged, slurmctld and slurmd (Debian's slurm-wlm), one node.

Why real: deploy/slurm/ckptless.sbatch is run as a user runs it (``sbatch``, then
``srun`` starting one agent per node); only the cluster is small. Everything
lives in one temporary directory (the munge key and socket, slurm.conf, state,
spool, logs) on free ports, and every daemon is stopped at the end. Needs root
(slurmd runs jobs as their user) and the binaries ``make test`` installs
(``make sysdeps``); the test is skipped, saying why, where they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from ckptless.coordinator.embedded import free_port

from .waiting import wait_until

BINARIES = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch", "/usr/bin/sinfo")


def missing() -> str | None:
    """Why a local Slurm cannot run here (None: it can)."""
    gone = [b for b in BINARIES if not os.access(b, os.X_OK)]
    if gone:
        return f"{', '.join(gone)} missing (make sysdeps installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "a local slurmd needs root"
    return None


class LocalSlurm:
    """``with LocalSlurm(dir) as slurm: slurm.sbatch([...], env)``."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root, self.cpus = root, cpus
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conf = root / "slurm.conf"
        self.env: dict[str, str] = {}

    def __enter__(self) -> LocalSlurm:
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = r / "munge" / "munge.socket"
        self._start(["/usr/sbin/munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={r / 'munge' / 'munged.pid'}", f"--seed-file={r / 'munge' / 'munge.seed'}",
                     f"--log-file={r / 'munge' / 'munged.log'}"], "munged")
        wait_until(sock.exists, 20, "munged's socket", interval_s=0.05)
        ctl, node = free_port(), free_port()
        memory = max(512, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) // 2)
        self.conf.write_text("\n".join([
            "ClusterName=ckptless", "SlurmctldHost=localhost", f"SlurmctldPort={ctl}", f"SlurmdPort={node}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}", f"SlurmdLogFile={r / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none", "ReturnToService=2",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "SwitchType=switch/none", "MailProg=/bin/true",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
        self.env = {"SLURM_CONF": str(self.conf)}
        self._start(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._start(["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(self.conf)], "slurmd")
        try:
            wait_until(lambda: self._node_state() in ("idle", "mixed"), 60, "the local slurmd idle in sinfo",
                       interval_s=0.2)
        except AssertionError as exc:
            self.__exit__()
            raise AssertionError(f"{exc}\n{self.logs()}") from exc
        return self

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, "SLURM_CONF": str(self.conf)}))

    def _node_state(self) -> str:
        out = subprocess.run(["/usr/bin/sinfo", "-h", "-N", "-o", "%t"], env={**os.environ, **self.env},
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().rstrip("*~#")

    def logs(self) -> str:
        text = []
        for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            text.append(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(text)

    def sbatch(self, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
        """``sbatch --wait ...`` (its exit status is the job's), running in the background."""
        return subprocess.Popen(["/usr/bin/sbatch", "--wait", *argv], env={**env, **self.env}, cwd=cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        shutil.rmtree(self.root / "munge", ignore_errors=True)  # the key
