"""The simulator asked to predict published measurements (bench/data/published/*.json).

Each case file holds a setup as its source states it (what the source leaves out marked ASSUMED),
the reported figure, its source and the bound its prediction must stay within. Kinds:

- decode_offline: a server's offline output tokens per second (`SimEngine` over the stated requests);
- decode_step: one decoding step's seconds at a batch and context (the cost model's formula);
- train_throughput: training tokens per second per GPU (the training term of the cost model);
- rl_speedup: synchronous over asynchronous seconds per trained token of an RL run
  (`bench.projection.asynchronous.async_projection` at the case's GPUs, batch and staleness).

    python -m bench.projection.published                     # every case, as a table
    python -m bench.projection.published bench/data/published/areal_v03_7b_async_speedup.json
    python -m bench.projection.published --fit               # refit the two shares of cost_model.py
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from bench.projection import cost_model as cm
from rlrecipe.checks import gpu_costs as gc
from rlrecipe.trajectory.record import SamplingParams, Trajectory

CASES = Path(__file__).parents[1] / "data" / "published"
SHIPPED = Path(__file__).parents[2] / "rlrecipe" / "model_configs"


def load(path: str | Path) -> dict:
    case = json.loads(Path(path).read_text())
    case["id"] = Path(path).stem
    return case


def all_cases() -> list[dict]:
    return [load(p) for p in sorted(CASES.glob("*.json"))]


def _dims(case: dict):
    cfg = case["setup"].get("model_dims")
    if cfg is None:
        name = case["projection"]["model_config"].replace("/", "__")
        cfg = json.loads((SHIPPED / f"{name}.json").read_text())
    return cm.dims_of(cfg)


def _device(case: dict) -> gc.Device:
    kind = case["setup"]["gpu_kind"]
    if "A100" in kind:
        return gc.DEVICES["A100-80GB"]
    return gc.DEVICES["H100-HBM2e-500W" if "HBM2e" in kind else "H100"]


# -- decode_offline ------------------------------------------------------------------------------
OFFLINE_PROMPT = 230  # the case file's assumed prompt length
OFFLINE_MEAN_OUT, OFFLINE_SIGMA, OFFLINE_CUT = 194.4, 1.0, 2048


def _offline_run(case: dict) -> tuple[dict, int]:
    """The SimEngine's counters over the case's requests (the schedule does not depend on the cost), and
    the output tokens generated."""
    from bench.projection.lengths import Lengths
    from bench.projection.sim import CostModel, SimEngine

    d = _dims(case)
    rng = random.Random(0)
    n = 5000
    mu = math.log(OFFLINE_MEAN_OUT) - OFFLINE_SIGMA ** 2 / 2  # a log-normal of this mean
    lengths = [max(1, min(OFFLINE_CUT - 1, round(rng.lognormvariate(mu, OFFLINE_SIGMA)))) for _ in range(n)]
    gib = 2 ** 30
    kv = int((0.88 * 80 * gib - 2 * d.params()) // d.kv_bytes_per_token(2))
    zero = CostModel(0, 0, 0, 0, 0)
    engine = SimEngine(zero, Lengths(OFFLINE_CUT, groups=lengths), layout="server", kv_tokens=kv, kv_reserve=0.3)
    trajs = [Trajectory(uid=f"r{i}#0", prompt_ids=[1] * OFFLINE_PROMPT, group_id=f"r{i}") for i in range(n)]
    engine.generate(trajs, SamplingParams(max_new_tokens=OFFLINE_CUT))
    c = engine.counters
    counters = {"decode_steps": c.decode_steps, "decode_rows": c.decode_rows, "decode_cells": c.decode_cells,
                "prefill_calls": c.prefill_calls, "prefill_tokens": c.prefill_tokens}
    return counters, sum(len(t.response_ids) for t in trajs)


_OFFLINE: dict[str, tuple[dict, int]] = {}


def predict_decode_offline(case: dict, share: float = gc.DECODE_SHARE) -> float:
    from bench.projection.sim import rollout_seconds

    if case["id"] not in _OFFLINE:
        _OFFLINE[case["id"]] = _offline_run(case)
    counters, out = _OFFLINE[case["id"]]
    cost = cm.gpu_cost(_dims(case), _device(case), decode_share=share)
    return out / rollout_seconds(cost, counters)


# -- decode_step ---------------------------------------------------------------------------------
STEP_BATCH, STEP_CONTEXT = 4 * 1.56417, 330  # the case file's assumed batch (Little's law) and context


def predict_decode_step(case: dict, share: float = gc.DECODE_SHARE) -> float:
    cost = cm.gpu_cost(_dims(case), _device(case), decode_share=share)
    return 1e3 * (cost.step_s + cost.row_s * STEP_BATCH + cost.ctx_s * STEP_BATCH * STEP_CONTEXT)


# -- train_throughput ----------------------------------------------------------------------------
TRAIN_SEQ = 8192  # the case file's assumed sequence length


def predict_train_throughput(case: dict, share: float = gc.TRAIN_SHARE) -> float:
    return share * _device(case).bf16_flops / gc.train_flops_per_token(_dims(case), TRAIN_SEQ, rl=False)


# -- rl_speedup ----------------------------------------------------------------------------------
def rl_rows(case: dict) -> dict:
    """The projection's rows for the case (async_projection under the fitted model)."""
    from bench.projection.asynchronous import areal_groups, async_projection
    from bench.projection.push import WEIGHT_BYTES_7B

    p = case["projection"]
    d = _dims(case)
    groups, label = areal_groups()
    mean_response = sum(min(x, 27648) for g in groups for x in g) / sum(len(g) for g in groups)
    cost = cm.gpu_cost(d, _device(case), train_seq_len=256 + mean_response)
    weight_bytes = WEIGHT_BYTES_7B * 2 * d.params() / 15.2e9
    res = async_projection(p["recipe"], groups, lengths_label=label, etas=(p["eta"],), steps=p["steps"], cost=cost,
                           cost_name=cost.label, weight_bytes=weight_bytes, overrides=p["overrides"], cache={})
    return {r["schedule"]: r for r in res["rows"]}


def predict_rl_speedup(case: dict) -> float:
    p = case["projection"]
    rows = rl_rows(case)
    return rows[p["sync_row"]]["s_per_1m_trained_tokens"] / rows[p["async_row"]]["s_per_1m_trained_tokens"]


PREDICT = {"decode_offline": predict_decode_offline, "decode_step": predict_decode_step,
           "train_throughput": predict_train_throughput, "rl_speedup": predict_rl_speedup}


def predict(case: dict) -> dict:
    """The case's prediction beside its reported figure, the relative error and whether it is in bounds."""
    got = PREDICT[case["kind"]](case)
    want = case["reported"]["value"]
    err = got / want - 1
    return {"case": case["id"], "source": case["source"].split(",")[0], "figure": case["reported"]["figure"],
            "reported": want, "predicted": got, "error": err, "bound": case["bound"],
            "within": abs(err) <= case["bound"]}


def fit() -> dict:
    """The two shares of cost_model.py from their cases, with each case's residual."""
    cases = {c["id"]: c for c in all_cases()}
    dec = [cases["sglang_llama31_8b_a100_offline"], cases["sglang_llama31_8b_a100_online_itl"]]
    # a throughput rises with the share, a step's seconds fall: fit seconds (1 / throughput) and ms alike
    decode, dres = cm.fit_share(lambda s: [1 / predict_decode_offline(dec[0], s), predict_decode_step(dec[1], s)],
                                [1 / dec[0]["reported"]["value"], dec[1]["reported"]["value"]])
    tr = [cases["torchtitan_llama31_8b_fsdp_8xh100"], cases["torchtitan_llama31_8b_fsdp_128xh100"]]
    train, tres = cm.fit_share(lambda s: [1 / predict_train_throughput(c, s) for c in tr],
                               [1 / c["reported"]["value"] for c in tr])
    # residuals as figures are reported: throughput residuals back from seconds
    return {"decode_share": decode, "train_share": train,
            "residuals": {dec[0]["id"]: 1 / (1 + dres[0]) - 1, dec[1]["id"]: dres[1],
                          tr[0]["id"]: 1 / (1 + tres[0]) - 1, tr[1]["id"]: 1 / (1 + tres[1]) - 1}}


def markdown(rows: list[dict]) -> str:
    lines = ["| case | source | figure | reported | predicted | error | bound |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['source']} | {r['figure']} | {r['reported']:g} | {r['predicted']:.4g} | "
                     f"{r['error']:+.1%} | {r['bound']:.0%}{'' if r['within'] else ' (missed)'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", nargs="?", help="a case file (default: every case in bench/data/published/)")
    ap.add_argument("--fit", action="store_true", help="refit the cost model's two shares and print them")
    args = ap.parse_args(argv)
    if args.fit:
        print(json.dumps(fit(), indent=2))
        return []
    rows = [predict(load(args.case))] if args.case else [predict(c) for c in all_cases()]
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
