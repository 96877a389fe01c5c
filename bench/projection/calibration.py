"""The cost model fitted to a measured run: non-negative least squares over the simulator's features.

`calibrate` replays a recorded run's schedules on the simulator (bench/projection/sim.py) for each
step's features and fits the measured seconds to them; from `make bench-sglang` output on a GPU,
or from `make bench` on CPU, where the calibrated projection should come back to the measured CPU
ratio (a check of the simulator).
"""

from __future__ import annotations

from dataclasses import replace

from bench.projection.sim import COMPONENTS, FEATURES, PHASES, CostModel, rollout_seconds, simulate


def nnls(rows: list[list[float]], y: list[float], iters: int = 200) -> list[float]:
    """Non-negative least squares, min |A x - y| with x >= 0 (Lawson-Hanson active set), columns
    scaled to unit norm first so features of very different sizes are treated alike."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)
    scale = a.norm(dim=0)
    scale[scale == 0] = 1
    a = a / scale
    n = a.shape[1]
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        candidates = (~passive) & (w > 1e-12 * max(1.0, float(w.abs().max())))
        if not candidates.any():
            break
        passive[int(torch.where(candidates, w, torch.full_like(w, -torch.inf)).argmax())] = True
        while True:
            z = torch.zeros(n, dtype=torch.float64)
            z[passive] = torch.linalg.lstsq(a[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float((x[neg] / (x[neg] - z[neg])).min())
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return (x / scale).tolist()


def fit(samples: list[tuple[dict, float]], params: tuple[str, ...], held: CostModel | None = None) -> dict[str, float]:
    """Least-squares (non-negative) values of `params` from (counters, seconds) samples; the other
    parameters keep their values in `held` (their share of the seconds is taken off first)."""
    rows = [[float(c.get(FEATURES[p], 0)) for p in params] for c, _ in samples]
    rest = [s - (sum(getattr(held, p) * c.get(f, 0) for p, f in FEATURES.items() if p not in params) if held else 0)
            for c, s in samples]
    return dict(zip(params, nnls(rows, rest), strict=True))


def condition_number(samples: list[tuple[dict, float]], params: tuple[str, ...]) -> float:
    """Of the column-normalised feature matrix: large (say > 100) when these samples cannot tell
    the parameters apart, e.g. steps that all look alike; fit fewer parameters then."""
    import torch

    a = torch.tensor([[float(c.get(FEATURES[p], 0)) for p in params] for c, _ in samples], dtype=torch.float64)
    a = a[:, a.norm(dim=0) > 0]
    if a.shape[1] == 0:
        return float("inf")
    sv = torch.linalg.svdvals(a / a.norm(dim=0))
    return float(sv[0] / sv[-1]) if sv[-1] > 0 else float("inf")


def calibrate(trace: dict, *, by: str = "total", layout: str | None = None, params: tuple[str, ...] | None = None,
              held: CostModel | None = None) -> tuple[CostModel, dict]:
    """Fit a cost model to a recorded run: the simulator replays both schedules (features per
    step), and the measured per-step seconds are fitted to them. by "total": each step's wall
    seconds (all a server run gives); by "components": the engine's own per-step split
    (decode + sampling, prefill, refill seconds), each fitted to its own features; by "events":
    each prefill, decoding step and refill the engine recorded, fitted to its own work, so the
    step totals (and the sync / C3PO++ ratio) stay out of the fit and test it.

    `params`: the parameters to fit (default: all that the layout has); the others keep their
    values in `held` (default 0). Few, similar steps (a short server run) cannot separate many
    parameters: the check's condition number says so, and fitting fewer is then the remedy.

    Returns the model and a check: how far the replayed schedule is from the recorded one where
    the run kept counters, how well the fit reproduces the measured steps, and the conditioning."""
    layout = layout or trace["settings"].get("layout") or "server"
    zero = CostModel(0, 0, 0, 0, 0)
    held = held or zero
    replay = simulate(trace, zero, layout=layout)
    measured = trace["steps"]
    params = tuple(p for p in (params or FEATURES) if layout == "inprocess" or p not in ("refill_cell_s", "prefill_cell_s"))
    pairs = [(sim["counters"], real) for mode in ("sync", "c3po")
             for sim, real in zip(replay[mode], measured[mode], strict=True)]
    # where the run kept its engine's counters, how far the replayed schedule is from it
    kept = [(sim, real["counters"]) for sim, real in pairs if real.get("counters")]
    check = {f"replay_gap_{k}": max(abs(sim.get(k, 0) - real.get(k, 0)) / max(1, real.get(k, 0))
                                    for sim, real in kept)
             for k in ("forward_passes", "decode_rows", "decode_cells", "prefill_tokens", "prefill_cells",
                       "refill_cells")} if kept else {}
    values: dict[str, float] = {}
    if by == "events":
        events = [e for mode in ("sync", "c3po") for st in measured[mode] for e in st.get("events", ())]
        if not events:
            raise ValueError("by='events' needs a run whose engine kept its events (the in-process engine does)")
        for phase, group in PHASES.items():
            group = tuple(p for p in group if p in params)
            samples = [(work, secs) for ph, secs, work in events if ph == phase]
            if group and samples:
                values.update(fit(samples, group, held))
                check[f"condition_number_{phase}"] = condition_number(samples, group)
    elif by == "components":
        for secs, group in COMPONENTS.items():
            group = tuple(p for p in group if p in params)
            if group:
                samples = [(sim, sum(real["counters"][k] for k in secs)) for sim, real in pairs]
                values.update(fit(samples, group, held))
                check[f"condition_number_{secs[0][:-2]}"] = condition_number(samples, group)
    else:
        samples = [(sim, real["seconds"]) for sim, real in pairs]
        values = fit(samples, params, held)
        check["condition_number"] = condition_number(samples, params)
    cost = replace(held, **values, label=f"calibrated ({by}; {', '.join(values)}) from a measured run, layout {layout}")
    predicted = [rollout_seconds(cost, sim) for sim, _ in pairs]
    actual = [real["seconds"] for _, real in pairs]
    mean = sum(actual) / len(actual)
    ss_res = sum((p - a) ** 2 for p, a in zip(predicted, actual, strict=True))
    ss_tot = sum((a - mean) ** 2 for a in actual) or 1.0
    check.update(r2_step_seconds=1 - ss_res / ss_tot,
                 max_rel_error_step_seconds=max(abs(p - a) / a for p, a in zip(predicted, actual, strict=True)))
    return cost, check


def fit_train_model(rows: list[dict]) -> tuple[float, float]:
    """(train_step_s, train_token_s) from RL metrics rows (train_s, tokens_trained)."""
    x = nnls([[1.0, float(r["tokens_trained"])] for r in rows], [r["train_s"] for r in rows])
    return x[0], x[1]
