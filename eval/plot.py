"""`rlrecipe plot RUN...`: PNG curves of runs' metrics, several runs overlaid for comparison."""

from __future__ import annotations

import json
from pathlib import Path

from rlrecipe.core.errors import UserError

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
    rows, bad = [], []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
        else:
            bad.append(lineno)
    if bad:  # a run killed mid-write leaves its last line cut short: the complete ones are plotted
        from rlrecipe.core.console import console

        console.print(f"{path}: skipped {len(bad)} unreadable line(s) (line {bad[0]}{' ...' if len(bad) > 1 else ''})",
                      highlight=False, soft_wrap=True)
    return rows


def plot_runs(runs: list[Path], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {str(r): read_metrics(Path(r)) for r in runs}
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot write there ({err.strerror or err})") from None
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
