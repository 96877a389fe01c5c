"""`rlrecipe plot RUN...`: PNG curves of runs' metrics, several runs overlaid for comparison."""

from __future__ import annotations

import json
from pathlib import Path

from rlrecipe.errors import UserError

PANELS = [
    ("reward_mean", "reward"), ("accuracy", "train accuracy"), ("response_len_mean", "response length"),
    ("entropy", "entropy"), ("grad_norm", "grad norm"), ("icepop_masked_frac", "IcePop masked fraction"),
    ("mismatch_abs_logp", "mean |logp_train - logp_infer|"), ("mismatch_kl", "mismatch KL (k3, per token)"),
    ("staleness_mean", "mean staleness of trained tokens (steps)"), ("gen_tokens_per_s", "generated tokens/s"),
    ("loss", "loss"), ("tokens_per_s", "trained tokens/s"),
]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_runs(runs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {str(r): read_metrics(Path(r)) for r in runs}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, title in PANELS:
        series = {name: [(m["step"], m[key]) for m in rows if key in m] for name, rows in data.items()}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, points in series.items():
            if points:
                ax.plot(*zip(*points, strict=True), label=Path(name).name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if not written:
        raise UserError("none of the runs has metrics to plot")
    return written
