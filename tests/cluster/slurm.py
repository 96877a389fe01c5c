"""The real two-node Slurm that `make slurm-local` starts (scripts/slurm_local/up.sh): found, jobs
submitted to it with `sbatch`, and the processes a job has on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = ("127.0.0.1", "127.0.0.2")


def slurm_conf() -> Path:
    return Path(os.environ.get("RLRECIPE_SLURM_CONF") or REPO / ".slurm-local" / "slurm.conf")


def _absent(why: str):
    """Skip in one line, or fail where CI asked for the Slurm tests (RLRECIPE_SLURM_LIVE=1)."""
    if os.environ.get("RLRECIPE_SLURM_LIVE") == "1":
        pytest.fail(why + " (RLRECIPE_SLURM_LIVE=1 asks for the Slurm tests)")
    pytest.skip(why)


def slurm_env() -> dict:
    """The environment a job is submitted with (sbatch passes it on to every step), or a skip in one
    line when no local Slurm answers."""
    conf = slurm_conf()
    if shutil.which("sbatch") is None or not conf.is_file():
        _absent(f"no local Slurm ({conf}): `make slurm-local` starts one")
    env = {**os.environ, "SLURM_CONF": str(conf), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("SGLANG_API_KEY", None)
    state = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True, timeout=30)
    idle = {line.split()[0] for line in state.stdout.splitlines() if line.split()[-1] in ("idle", "mix", "alloc")}
    if state.returncode != 0 or not set(NODES) <= idle:
        _absent(f"local Slurm ({conf}) not up with nodes {', '.join(NODES)}: `make slurm-local` starts it")
    return env


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class Job:
    """A job submitted with `sbatch` from its script's folder, followed with scontrol: its id at once,
    its exit status once finished (polled every 0.25 s: `sbatch --wait` polls ever more slowly, up to
    half a minute past the job's end)."""

    def __init__(self, script: Path, env: dict, *args: str):
        self.env = env
        done = subprocess.run(["sbatch", "--parsable", str(script), *args], cwd=script.parent, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip(), f"sbatch {script}: {done.stderr}"
        self.id = int(done.stdout.strip().split(";")[0])

    def _show(self) -> dict:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(self.id)], env=self.env, capture_output=True,
                             text=True, timeout=60).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, timeout_s: float = 900) -> int:
        """The batch script's exit status (a signal that ended it: 128 + its number)."""
        try:
            wait_until(lambda: self._show().get("JobState") in FINISHED, timeout_s, f"job {self.id}", poll_s=0.25)
        except AssertionError:
            self.cancel()
            raise
        status, _, signal = self._show()["ExitCode"].partition(":")
        return int(status) or (128 + int(signal) if int(signal or 0) else 0)

    def cancel(self) -> None:
        subprocess.run(["scancel", str(self.id)], env=self.env, timeout=60)
        wait_until(lambda: self._show().get("JobState") in FINISHED, 120, f"job {self.id} cancelled", poll_s=0.25)

    def requeue(self) -> None:
        """Back to the queue, as Slurm does with a job on a failed node; started again at once (Slurm
        holds a requeued job for two minutes first)."""
        subprocess.run(["scontrol", "requeue", str(self.id)], env=self.env, check=True, timeout=60)
        wait_until(lambda: self.state() == "PENDING", 120, f"job {self.id} back in the queue", poll_s=0.25)
        subprocess.run(["scontrol", "update", f"JobId={self.id}", "StartTime=now"], env=self.env, check=True,
                       timeout=60)

    def state(self) -> str:
        """Its state as squeue says it (PENDING, RUNNING, COMPLETING, ...), '' once it has left the queue."""
        return subprocess.run(["squeue", "-h", "-j", str(self.id), "-o", "%T"], env=self.env, capture_output=True,
                              text=True, timeout=60).stdout.strip()

    def queued(self) -> bool:
        return bool(self.state())


def submit(script: Path, env: dict, *args: str, timeout_s: float = 900) -> tuple[int, int]:
    """The finished job's exit status and its id."""
    job = Job(script, env, *args)
    return job.wait(timeout_s), job.id


def job_output(folder: Path, job: int) -> str:
    (path,) = folder.glob(f"*-{job}.out")
    return path.read_text(errors="replace")


def job_processes(job: int, node: str | None = None) -> list:
    """The processes of a job's steps on this machine (on `node` alone if given), found by the variables
    Slurm gave them: what a node would still run of the job."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") == str(job) and (node is None or env.get("SLURMD_NODENAME") == node):
            found.append(proc)
    return found


def kill_node(job: int, node: str) -> int:
    """Every process of the job on `node`, SIGKILL at once (a node lost): how many there were."""
    import psutil

    procs = job_processes(job, node)
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return len(procs)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f}s"
        time.sleep(poll_s)
