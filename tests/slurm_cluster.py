"""A throwaway single-node SLURM cluster for tests: munged + slurmctld + slurmd.

Everything (munge key and socket, slurm.conf, state, spool, logs, PID files)
lives in one temporary folder, the daemons listen on free ports, and `stop()`
ends exactly the processes that `start()` launched, by PID. Client commands
(`sbatch`, `squeue`, `scontrol`, ...) find the cluster through the
`SLURM_CONF` variable in `LocalSlurmCluster.env`.

Needs Debian's `slurm-wlm` and `munge` (see `slurm/ci_setup.sh`) and root,
because slurmd launches job steps as the submitting user.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

from helpers import PATIENCE_S
from slurm_tools import free_port

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun")


def missing_requirements() -> str | None:
    """Why a local cluster cannot start here (a sentence), or None when it can."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None and not os.path.exists(f"/usr/sbin/{p}")]
    if missing:
        return f"SLURM/munge programs not installed ({', '.join(missing)}); run slurm/ci_setup.sh"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd starts job steps as the submitting user)"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurmCluster:
    """One node (this host), one partition, requeue allowed.

    Usage::

        cluster = LocalSlurmCluster(tmp_path)
        cluster.start()
        try:
            subprocess.run(["sbatch", ...], env=cluster.env)
        finally:
            cluster.stop()
    """

    def __init__(self, root: pathlib.Path):
        self.root = pathlib.Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.conf = self.root / "slurm.conf"
        self.pids: dict[str, int] = {}
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- configuration -------------------------------------------------------------------
    def _write_munge(self) -> list[str]:
        d = self.root / "munge"
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        return [
            _program("munged"), "--force",
            f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ]

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        cpus = os.cpu_count() or 1
        r = self.root
        self.conf.write_text(
            f"""\
ClusterName=mhartest
SlurmctldHost={self.node}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobRequeue=1
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
KillWait=10
MinJobAge=600
InactiveLimit=0
NodeName={self.node} CPUs={cpus} RealMemory={int(mem_mib * 0.8)} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    # -- lifecycle -------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.console", "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True)
        self.pids[name] = proc.pid
        self._procs = getattr(self, "_procs", {})
        self._procs[name] = proc

    def start(self, timeout: float = PATIENCE_S) -> None:
        """Start munged, slurmctld and slurmd in the foreground (-F/-D) and wait until the node is idle.

        Raises RuntimeError (with the daemon logs) when the node does not come up in `timeout` seconds.
        """
        self._write_conf()
        self._spawn("munged", self._write_munge() + ["--foreground"])
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn("slurmctld", [_program("slurmctld"), "-D", "-f", str(self.conf)])
        self._wait_for(lambda: self._run(["scontrol", "ping"]).stdout.count("UP") > 0, timeout, "slurmctld")
        self._spawn("slurmd", [_program("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        self._wait_for(lambda: self.node_state() == "idle", timeout, "slurmd node idle")

    def stop(self) -> None:
        """SIGTERM each daemon this object started (by PID), then SIGKILL whatever is left after 10 s."""
        for name in ("slurmd", "slurmctld", "munged"):
            proc = getattr(self, "_procs", {}).get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    # -- helpers ---------------------------------------------------------------------------
    def _run(self, argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=PATIENCE_S)

    def node_state(self) -> str:
        return self._run(["sinfo", "-h", "-n", self.node, "-o", "%t"]).stdout.strip()

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").iterdir()):
            out.append(f"==> {f.name} <==\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in getattr(self, "_procs", {}).items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n{self.logs()}")
            try:
                if predicate():
                    return
            except subprocess.SubprocessError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def job_field(self, job_id: str, field: str) -> str:
        """One `Field=value` entry of `scontrol show job` (for example JobState, Restarts)."""
        out = self._run(["scontrol", "show", "job", "-o", job_id]).stdout
        for token in out.split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        return ""
