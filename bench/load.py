"""The machine's load over one benchmark, recorded beside it, and whether it was taken on a busy machine.

A ratio of two arms measured while other work competes for the cores says more about that work than
about the arms (issue: `async_vs_shared_per_step` 3.66 with a range of 1.12 to 4.07 in one run). So
`make bench` records, over each benchmark:

- `load1_start`, `load1`: the 1-minute load average (/proc/loadavg) before and after;
- `run_queue_median`, `run_queue_max`: runnable tasks on the machine (/proc/stat `procs_running`,
  sampled every `interval` seconds, the sampler itself left out), and `others_running_median`: those
  of them outside this process and its children (their own threads counted from /proc/PID/task);
- `steal_share`: the CPU time the hypervisor gave to other guests, of all CPU time (/proc/stat `cpu`
  line's steal over its total, between the start and the end);
- `others_cpu_cores`: cores' worth of CPU that processes outside this one and its children used
  (the machine's busy time from /proc/stat less this process tree's from getrusage, per wall second);
- `busy`: true when the load came from elsewhere and exceeded what the cores could give: other
  processes used half a core or more (`others_cpu_cores` >= 0.5), or steal took 5% or more, or the
  run queue exceeded the cores with another process's task among it. `make bench` prints a warning
  for it and docs/bench-results.md marks the benchmark, so its figures read as taken on a busy
  machine, not as a finding.

The readers take the files' text, so the tests give them text they wrote.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path
from statistics import median

HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
OTHERS_CPU_BUSY = 0.5  # cores' worth used by other processes
STEAL_BUSY = 0.05      # share of CPU time stolen by the hypervisor


def read_loadavg(text: str) -> dict:
    """/proc/loadavg: "0.52 0.58 0.59 2/345 12345" -> the 1-minute load, runnable and all tasks."""
    fields = text.split()
    running, total = fields[3].split("/")
    return {"load1": float(fields[0]), "running": int(running), "tasks": int(total)}


def read_stat(text: str) -> dict:
    """/proc/stat: the aggregate `cpu` line's jiffies (busy: all but idle, iowait and steal; steal;
    total) and `procs_running`."""
    out: dict = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            v = [int(x) for x in parts[1:]] + [0] * 10
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]  # guest time is inside user
            out.update(busy=user + nice + system + irq + softirq, steal=steal,
                       total=user + nice + system + idle + iowait + irq + softirq + steal)
        elif parts and parts[0] == "procs_running":
            out["procs_running"] = int(parts[1])
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def tree_pids(root: int, proc: str = "/proc") -> set[int]:
    """`root` and its descendants, from each process's parent in /proc/PID/stat."""
    parent: dict[int, int] = {}
    for entry in os.listdir(proc):
        if entry.isdigit():
            stat = _read(f"{proc}/{entry}/stat")
            if stat:
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        children = [c for c, pp in parent.items() if pp == p and c not in out]
        out.update(children)
        frontier.extend(children)
    return out


def running_tasks(pids: set[int], proc: str = "/proc") -> int:
    """Threads of `pids` in state R (runnable)."""
    n = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            stat = _read(f"{proc}/{pid}/task/{tid}/stat")
            n += bool(stat) and stat.rsplit(")", 1)[1].split()[0] == "R"
    return n


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def summarise(*, cores: int, wall_s: float, stat0: dict, stat1: dict, load0: dict, load1: dict,
              own_cpu_s: float, samples: list[tuple[int, int]]) -> dict:
    """The record of one benchmark from its readings: `samples` are (procs_running less the sampler,
    of those outside this process tree) taken during it."""
    total = stat1.get("total", 0) - stat0.get("total", 0)
    steal = (stat1.get("steal", 0) - stat0.get("steal", 0)) / total if total > 0 else 0.0
    busy_s = (stat1.get("busy", 0) - stat0.get("busy", 0)) / HZ
    others = max(0.0, busy_s - own_cpu_s) / wall_s if wall_s > 0 else 0.0
    queue = [q for q, _ in samples] or [load1.get("running", 1) - 1]
    theirs = [o for _, o in samples] or [0]
    out = {"cores": cores, "wall_s": round(wall_s, 1), "load1_start": load0.get("load1", 0.0),
           "load1": load1.get("load1", 0.0), "run_queue_median": median(queue), "run_queue_max": max(queue),
           "others_running_median": median(theirs), "steal_share": round(steal, 4),
           "others_cpu_cores": round(others, 2), "samples": len(samples)}
    out["busy"] = is_busy(out)
    return out


def is_busy(rec: dict) -> bool:
    """Whether other work competed for the cores over the benchmark (see the module's docstring)."""
    return (rec["others_cpu_cores"] >= OTHERS_CPU_BUSY or rec["steal_share"] >= STEAL_BUSY
            or (rec["run_queue_median"] > rec["cores"] and rec["others_running_median"] >= 1))


def warning(name: str, rec: dict) -> str:
    """The line `make bench` prints for a benchmark taken on a busy machine."""
    return (f"WARNING {name} ran on a busy machine ({rec['cores']} cores: 1-min load {rec['load1_start']:.1f} -> "
            f"{rec['load1']:.1f}, run queue median {rec['run_queue_median']:g} of which others' "
            f"{rec['others_running_median']:g}, other processes {rec['others_cpu_cores']:.2f} cores, steal "
            f"{rec['steal_share']:.1%}): its figures are not a finding")


class LoadMeter:
    """`with LoadMeter() as m: ...` then `m.record`: the load over the block (`summarise`), sampled every
    `interval` seconds by a daemon thread."""

    def __init__(self, interval: float = 1.0, proc: str = "/proc"):
        self.interval, self.proc = interval, proc
        self.samples: list[tuple[int, int]] = []
        self.record: dict = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            running = read_stat(_read(f"{self.proc}/stat")).get("procs_running")
            if running is None:
                continue
            ours = running_tasks(tree_pids(os.getpid(), self.proc), self.proc)
            self.samples.append((max(0, running - 1), max(0, running - max(ours, 1))))  # ours: the sampler at least

    def __enter__(self) -> LoadMeter:
        self._t0, self._cpu0 = time.perf_counter(), own_cpu_s()
        self._stat0, self._load0 = read_stat(_read(f"{self.proc}/stat")), self._loadavg()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _loadavg(self) -> dict:
        text = _read(f"{self.proc}/loadavg")
        return read_loadavg(text) if text else {}

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.record = summarise(cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, wall_s=time.perf_counter() - self._t0,
                                stat0=self._stat0, stat1=read_stat(_read(f"{self.proc}/stat")), load0=self._load0,
                                load1=self._loadavg(), own_cpu_s=own_cpu_s() - self._cpu0, samples=self.samples)
