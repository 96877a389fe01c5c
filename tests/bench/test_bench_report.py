"""docs/bench-results.md is generated from bench/results.json, scalars only, env first."""

import json

from bench.report import write


def test_the_page_lists_every_scalar_and_names_the_run(tmp_path):
    results = {"packed_vs_padded": {"packed_speedup": 1.4512, "microbatches": 12, "trace": [1, 2]},
               "c3po_projection": {"x": 1.0}, "grading": {"fast_path_frac": 0.675, "kinds": {"a": 1}},
               "env": {"torch": "2.13.0", "threads": 2, "time": 0.0, "cpu": "Some CPU"}}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    text = write(src, tmp_path / "bench.md").read_text()
    assert "1970-01-01 00:00 UTC; torch 2.13.0, 2 threads, Some CPU" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| packed_vs_padded | packed_speedup | 1.451 |", "| packed_vs_padded | microbatches | 12 |",
                    "| grading | fast_path_frac | 0.675 |"]
