"""Paired rounds' statistics, the machine's load read from /proc text written here, the busy flag, and
how `make bench` reports them (bench/pairing.py, bench/load.py, bench/report.py), by hand."""

import json
from pathlib import Path

import pytest

from bench import load
from bench.load import LoadMeter, is_busy, read_loadavg, read_stat, summarise, warning
from bench.pairing import paired, paired_ratios, paired_rounds, ratio_summary
from bench.report import write

STAT = """cpu  1000 20 300 5000 40 5 6 70 0 0
cpu0 500 10 150 2500 20 2 3 35 0 0
cpu1 500 10 150 2500 20 3 3 35 0 0
intr 12345
ctxt 999
procs_running 3
procs_blocked 0
"""


def test_the_median_of_paired_ratios_and_their_range_by_hand():
    # round by round: 6/3, 10/4, 9/6 = 2.0, 2.5, 1.5 -> median 2.0, range 1.5 to 2.5; the arms' own
    # medians (9 / 4 = 2.25) and fastest-against-slowest (6 / 6 to 10 / 3) would say otherwise
    ratios = paired_ratios([6.0, 10.0, 9.0], [3.0, 4.0, 6.0])
    assert ratios == [2.0, 2.5, 1.5]
    assert ratio_summary("x", ratios) == {"x": 2.0, "x_min": 1.5, "x_max": 2.5, "x_rounds": 3}
    runs = {"a": [{"s": 6.0}, {"s": 10.0}, {"s": 9.0}, {"s": 8.0}], "b": [{"s": 3.0}, {"s": 4.0}, {"s": 6.0}, {"s": 2.0}]}
    assert paired(runs, "a_over_b", "a", "b", "s") == {"a_over_b": 2.25, "a_over_b_min": 1.5, "a_over_b_max": 4.0,
                                                       "a_over_b_rounds": 4}  # even: the mean of the middle two
    with pytest.raises(ValueError):
        paired_ratios([1.0, 2.0], [1.0])  # a round without its pair


def test_paired_rounds_takes_the_arms_in_turn_after_a_warm_up():
    calls = []
    times = paired_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2)
    assert calls == ["a", "b", "a", "b", "a", "b"] and [len(v) for v in times.values()] == [2, 2]


def test_the_load_is_read_from_proc_text():
    assert read_loadavg("2.51 1.98 1.20 4/345 12345\n") == {"load1": 2.51, "running": 4, "tasks": 345}
    stat = read_stat(STAT)
    # busy: user + nice + system + irq + softirq; total adds idle, iowait and steal
    assert stat == {"busy": 1000 + 20 + 300 + 5 + 6, "steal": 70,
                    "total": 1000 + 20 + 300 + 5000 + 40 + 5 + 6 + 70, "procs_running": 3}


def _record(**kw) -> dict:
    args = dict(cores=2, wall_s=10.0, stat0=read_stat(STAT), load0={"load1": 0.5}, load1={"load1": 2.0, "running": 3},
                own_cpu_s=15.0, samples=[(2, 0), (2, 0), (3, 1)])
    args.update(kw)
    return summarise(**args)


def test_a_quiet_benchmark_is_not_busy_and_a_competed_one_is():
    stat1 = dict(read_stat(STAT))
    # 10 s of wall clock on 2 cores: 1,600 busy jiffies (16 s at 100 per second), 15 s of them ours
    stat1.update(busy=stat1["busy"] + 1600, total=stat1["total"] + 2000, steal=stat1["steal"] + 0)
    quiet = _record(stat1=stat1)
    assert quiet["others_cpu_cores"] == pytest.approx(0.1) and quiet["steal_share"] == 0.0
    assert (quiet["run_queue_median"], quiet["run_queue_max"], quiet["others_running_median"]) == (2, 3, 0)
    assert (quiet["load1_start"], quiet["load1"], quiet["busy"]) == (0.5, 2.0, False)
    # another process using a core and a half: 3,000 busy jiffies, 15 s ours -> 1.5 cores
    stat1.update(busy=read_stat(STAT)["busy"] + 3000)
    competed = _record(stat1=stat1)
    assert competed["others_cpu_cores"] == pytest.approx(1.5) and competed["busy"] is True
    # the hypervisor stealing 10% of the time
    stolen = dict(read_stat(STAT), busy=read_stat(STAT)["busy"] + 1500, total=read_stat(STAT)["total"] + 2000,
                  steal=read_stat(STAT)["steal"] + 200)
    assert _record(stat1=stolen)["steal_share"] == 0.1 and _record(stat1=stolen)["busy"] is True
    assert "busy machine" in warning("x", competed) and "1.50 cores" in warning("x", competed)


def test_a_run_queue_over_the_cores_is_busy_only_with_someone_else_in_it():
    base = {"cores": 2, "others_cpu_cores": 0.2, "steal_share": 0.0}
    # a benchmark that runs a server beside a trainer fills the queue itself: not the machine's load
    assert not is_busy({**base, "run_queue_median": 4, "others_running_median": 0})
    assert is_busy({**base, "run_queue_median": 4, "others_running_median": 2})
    assert not is_busy({**base, "run_queue_median": 2, "others_running_median": 1})


def test_the_meter_reads_a_proc_it_is_given(tmp_path: Path, monkeypatch):
    (tmp_path / "stat").write_text(STAT)
    (tmp_path / "loadavg").write_text("3.00 2.00 1.00 5/100 42\n")
    monkeypatch.setattr(load, "own_cpu_s", lambda: 0.0)
    with LoadMeter(interval=0.01, proc=str(tmp_path)) as meter:
        while len(meter.samples) < 3:
            pass
    rec = meter.record
    # procs_running 3, less the sampler; none of this process's tasks are in the written /proc
    assert rec["run_queue_median"] == 2 and rec["others_running_median"] == 2
    assert rec["load1"] == 3.0 and rec["steal_share"] == 0.0 and rec["samples"] >= 3


def test_the_page_marks_a_busy_benchmark_and_lists_wall_times_and_load(tmp_path: Path):
    rec = _record(stat1=dict(read_stat(STAT), busy=read_stat(STAT)["busy"] + 3000,
                             total=read_stat(STAT)["total"] + 2000))
    results = {"grading": {"answers_per_s": 100.0, "busy": False},
               "async_vs_sync_cpu": {"async_vs_shared_per_step": 1.2, "busy": True},
               "bench_seconds": {"inputs": 1.0, "grading": 8.4, "async_vs_sync_cpu": 300.0, "total": 309.4,
                                 "mode_full": 1.0},
               "bench_load": {"grading": {**rec, "busy": False}, "async_vs_sync_cpu": rec},
               "env": {"torch": "2.13.0", "threads": 2, "time": 0.0, "cpu": "Some CPU"}}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    text = write(src, tmp_path / "bench.md").read_text()
    assert "**Taken on a busy machine** (other work competed for the cores; bench/load.py): async_vs_sync_cpu." in text
    assert "| async_vs_sync_cpu (BUSY) | async_vs_shared_per_step | 1.2 |" in text
    assert "| grading | answers_per_s | 100 |" in text
    assert "## Wall time and load per benchmark (make bench-full)" in text
    assert "| async_vs_sync_cpu | 300 | 0.50, 2.00 | 2 | 1.50 | 0.0% | BUSY |" in text
    assert "| grading | 8.4 | 0.50, 2.00 | 2 | 1.50 | 0.0% | no |" in text
    assert "| inputs | 1 | - | - | - | - | - |" in text and "| total | 309.4 |" in text
