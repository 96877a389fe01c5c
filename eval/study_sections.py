"""RESULTS.md's study sections: the mismatch study, asynchronous RL, DAPO / QAE / Dr. GRPO, the FP8
KV cache and LoRA, each rendered from its study.json."""

from __future__ import annotations

from typing import Any

from rlrecipe.eval.markdown import mean_sd, num, table, wrapped


def study_section(study: dict[str, Any]) -> str:
    """RESULTS.md's "Mismatch study": one line per (mismatch, level, correction)."""
    plan, rows = study.get("plan", {}), []
    for t in study.get("table", []):
        level = {"lag": lambda x: f"lag L={x:g}", "precision": lambda x: f"rollout {x}"}.get(
            t["dial"], lambda x: f"noise sigma={x:g}")(t["level"])
        evals = None if t["eval_avg_mean"] is None else 100 * t["eval_avg_mean"]
        eval_sd = None if t["eval_avg_sd"] is None else 100 * t["eval_avg_sd"]
        rows.append([level, t["correction"], " ".join(str(x) for x in t["seeds"]),
                     mean_sd(t["reward_final_mean"], t["reward_final_sd"], ".2f"), mean_sd(evals, eval_sd, ".1f"),
                     num(t["grad_norm_max"], ".2f"), num(t["masked_frac_mean"], ".4f"),
                     num(t["mismatch_kl_mean"], ".4f"), f"{t['collapsed']} of {len(t['seeds'])}", t["recipe"],
                     " ".join(sha[:12] for sha in t["recipe_sha256"]),
                     " ".join(c[:7] for c in t.get("commits", [])) or "-"])
    head = plan.get("headline")
    intro = (
        "Five recipes that differ only in the train/inference-mismatch correction (recipes/mismatch_*.yaml), "
        "trained from the tiny SFT model under a dialled mismatch: *noise sigma* is a stress test (Gaussian noise "
        "of that standard deviation on the rollout engine's logits), *lag L* a rollout engine that receives "
        "weights every L steps, *rollout DTYPE* the rollout in that dtype instead of bfloat16 (every other run "
        "samples in bfloat16 against a float32 trainer). Final reward: "
        f"mean training reward of the last steps (± sd across seeds); held-out: avg@n on tiny-arith eval, percent. "
        f"Collapse: {study.get('collapse_rule', '-')}. "
        + (f"Headline (all seeds): {head['dial']} {head['level']:g}. " if head else "")
        + (f"Also all seeds at lag {plan['lag_headline']['level']:g}, the first lag where the uncorrected run "
           "collapsed. " if plan.get("lag_headline") else "")
        + (f"(The rule chose {plan['headline_by_rule']:g}; overridden: {plan['headline_override_why']}) "
           if plan.get("headline_override_why") else "")
        + "`make mismatch-study` reruns it; figures in runs/mismatch-study/figures/.")
    intro = wrapped(intro)
    header = ["mismatch", "correction", "seeds", "final reward", "held-out avg", "max grad norm", "masked frac",
              "mismatch KL", "collapsed", "recipe", "sha256 (with the dial set)", "commit"]
    return "## Mismatch study\n\n" + intro + "\n" + table(header, rows)


def _async_rows(study: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in sorted(study.get("table", []), key=lambda t: (t["level"], t["correction"] != "off", t["correction"])):
        evals = None if t["eval_avg_mean"] is None else 100 * t["eval_avg_mean"]
        eval_sd = None if t["eval_avg_sd"] is None else 100 * t["eval_avg_sd"]
        rows.append(["synchronous" if not t["level"] else f"async L={t['level']:g}", t["correction"],
                     " ".join(str(x) for x in t["seeds"]), mean_sd(t["reward_final_mean"], t["reward_final_sd"], ".2f"),
                     mean_sd(evals, eval_sd, ".1f"), num(t["grad_norm_max"], ".2f"), num(t["masked_frac_mean"], ".4f"),
                     num(t["mismatch_kl_mean"], ".4f"), f"{t['collapsed']} of {len(t['seeds'])}", t["recipe"],
                     " ".join(sha[:12] for sha in t["recipe_sha256"]),
                     " ".join(c[:7] for c in t.get("commits", [])) or "-"])
    return rows


ASYNC_HEADER = ["schedule", "correction", "seeds", "final reward", "held-out avg", "max grad norm", "masked frac",
                "mismatch KL", "collapsed", "recipe", "sha256 (with the lag set)", "commit"]
EQUAL_STEPS_INTRO = (
    "The mismatch study's *off* and *icepop* arms (recipes/mismatch_off.yaml, recipes/mismatch_icepop.yaml) "
    "trained from the tiny SFT model synchronously and with `rl.async_lag` L: the batch of step s is "
    "collected under the weights of step s - L. Final reward: mean training reward of the last steps "
    "(± sd across seeds); held-out: avg@n on tiny-arith eval, percent. ")


def _time_rows(study: dict[str, Any]) -> list[list[str]]:
    rows = []
    for t in study.get("time_table", []):
        reach = ("never within the run" if t["reach_wall_s"] is None
                 else f"{t['reach_wall_s']:.0f} s (step {t['reach_step']})")
        seeds = ", ".join("never" if x is None else f"{x:.0f}" for x in t.get("reach_wall_s_seeds", []))
        final = None if t["final_avg"] is None else 100 * t["final_avg"]
        sd = None if t.get("final_avg_sd") is None else 100 * t["final_avg_sd"]
        rows.append(["synchronous" if not t["lag"] else f"async L={t['lag']}", t["correction"],
                     " ".join(str(x) for x in t["seeds"]), num(t["s_per_step"], ".2f"), num(t["wall_s_total"], ".0f"),
                     num(t["drain_s_total"], ".0f"), mean_sd(final, sd, ".1f"),
                     num(None if t["target_avg"] is None else 100 * t["target_avg"], ".1f"), reach,
                     f"{t['seeds_reaching']} of {len(t['seeds'])} ({seeds or '-'})",
                     ", ".join(num(x, ".2f") for x in t.get("s_per_step_seeds", [])) or "-"])
    return rows


def async_section(study: dict[str, Any] | None, earlier: dict[str, Any] | None = None) -> str:
    """RESULTS.md's "Asynchronous RL": with a time axis (held-out accuracy against wall-clock, the time each
    arm takes to reach the synchronous arm's final accuracy) when the study has one; one line per (lag,
    correction) over seeds at equal steps; and the earlier equal-steps study below it."""
    out = "## Asynchronous RL\n\n"
    if study and study.get("time_table"):
        plan = study.get("plan", {})
        intro = (
            "Synchronous (the best use of the 2 cores: the in-process engine, two threads in every phase) against "
            "`rl.async_lag` L (the batch of step s collected under the weights of step s - L, on a worker thread "
            "beside the trainer), each with IcePop, TIS and M2PO (recipes/mismatch_icepop.yaml, "
            "recipes/mismatch_tis.yaml, recipes/mismatch_m2po.yaml: the weight pi_old/pi_infer masked outside "
            "[0.5, 5], truncated at 2, or with M2PO's batch second-moment mask at 0.04; under a lag pi_old is the "
            "proximal policy recomputed at the trainer's weights and pi_infer the behaviour policy, so TIS is "
            "AReaL's decoupled PPO weight truncated), trained from the tiny SFT model. "
            f"Held-out avg@8 on tiny-arith every {plan.get('eval_every', '-')} steps (`rl.eval_every`). "
            "Wall-clock: the RL loop's seconds per step, validation left out; an asynchronous run's wait for the "
            "batches collected ahead before each validation (drain) is counted, which is pessimistic for async. "
            "Reach: the wall-clock at which the seed-mean held-out accuracy first reaches the synchronous arm's final "
            "one (same correction), then per seed. "
            + ("OpenMP wait, every arm: " + ", ".join(f"{k}={v}" for k, v in plan["openmp_wait"].items()) + ". "
               if plan.get("openmp_wait") else "")
            + (f"Note: {plan['note']} " if plan.get("note") else "")
            + (f"Figure: [{study['figure']}]({study['figure']}). " if study.get("figure") else "")
            + "`make async-study` reruns it.")
        out += wrapped(intro) + "\n" + table(
            ["schedule", "correction", "seeds", "s / step", "wall-clock s", "of which drain s", "final held-out avg",
             "sync's final", "reach sync's final at", "seeds reaching it (s)", "s / step per seed"], _time_rows(study))
        if study.get("figure"):
            out += f"\n![held-out accuracy against wall-clock and steps]({study['figure']})\n"
        out += "\n" + wrapped(
            "At equal steps (the same runs): final reward: mean training reward of the last steps (± sd across seeds); "
            f"held-out: the final evaluation, avg@8, percent. Collapse: {study.get('collapse_rule', '-')}.") + "\n"

        out += table(ASYNC_HEADER, _async_rows(study))
    elif study:
        intro = EQUAL_STEPS_INTRO + f"Collapse: {study.get('collapse_rule', '-')}. `make async-study` reruns it."
        out += wrapped(intro) + "\n" + table(ASYNC_HEADER, _async_rows(study))
    if earlier:
        out += (("\n" if study else "") + "### Equal steps only (the first async study)\n\n"
                + wrapped(EQUAL_STEPS_INTRO + f"Collapse: {earlier.get('collapse_rule', '-')}.") + "\n"
                + table(ASYNC_HEADER, _async_rows(earlier)))
    return out


OPTION_METRICS = {"dynamic_sampling": [("ds_signal_share", "signal share", ".2f"), ("ds_cap_hit", "cap hit", ".2f")],
                  "overlong": [("overlong_filtered_frac", "filtered", ".3f"),
                               ("overlong_penalty_mean", "penalty", ".3f")],
                  "qae": [("adv_zero_frac", "zero advantage", ".2f")],
                  "dr_grpo": [("adv_zero_frac", "zero advantage", ".2f")]}


def options_section(study: dict[str, Any]) -> str:
    """RESULTS.md's "DAPO, QAE and Dr. GRPO": one line per arm, over seeds."""
    rows = []
    for t in study.get("table", []):
        evals = None if t["eval_avg_mean"] is None else 100 * t["eval_avg_mean"]
        eval_sd = None if t["eval_avg_sd"] is None else 100 * t["eval_avg_sd"]
        shown = t.get("arm_metrics", {})
        own = ", ".join(f"{label} {num(shown.get(key), fmt)}" for key, label, fmt in OPTION_METRICS.get(t["arm"], []))
        rows.append([t["arm"], t["recipe"] + "".join(f" `--set {s}`" for s in t.get("sets", [])),
                     " ".join(str(x) for x in t["seeds"]), mean_sd(evals, eval_sd, ".1f"),
                     mean_sd(t["entropy_final_mean"], t["entropy_final_sd"], ".3f"),
                     num(t["reward_final_mean"], ".2f"), num(t.get("tokens_generated_mean"), ",.0f"),
                     num(shown.get("truncated_frac"), ".3f"), own or "-",
                     f"{t['collapsed']} of {len(t['seeds'])}", " ".join(sha[:12] for sha in t["recipe_sha256"]),
                     " ".join(c[:7] for c in t.get("commits", [])) or "-"])
    intro = ("Each option's recipe (tiny_rl with it on alone) against tiny_rl, trained from the tiny SFT model; "
             "group_control is tiny_rl with `rl.adv_norm=group`, since QAE's and Dr. GRPO's baselines are per group "
             "where tiny_rl normalises over the batch. Held-out: avg@8 on tiny-arith eval, percent (± sd across "
             "seeds); entropy: mean token entropy of the last steps; final reward: mean training reward of the last "
             "steps (with dynamic sampling, over the groups it kept: groups all right are left out, so it reads "
             "lower); tokens generated: over the whole run; the option's own metrics are means over steps (cap hit: the share of steps where the cap let "
             "groups without signal train). "
             f"Collapse: {study.get('collapse_rule', '-')}. `make options-study` reruns it."
             + (f" Note: {study['plan']['note']}." if study.get("plan", {}).get("note") else ""))
    header = ["arm", "recipe", "seeds", "held-out avg@8", "entropy at the end", "final reward", "tokens generated",
              "truncated frac",
              "its metrics", "collapsed", "sha256 (with the seed set)", "commit"]
    return "## DAPO, QAE and Dr. GRPO\n\n" + wrapped(intro) + "\n" + table(header, rows)


FP8_HEADER = ["KV cache", "correction", "seeds", "mismatch: mean abs(log π_train − log π_infer)",
              "IcePop-masked share", "held-out avg@8", "collapsed", "wall-clock s", "commit"]


def _fp8_missing(study: dict[str, Any]) -> list[str]:
    """What the study's design has and its table lacks (arms, seeds, steps, single runs), and the runs
    that did not finish: empty for a complete study. A study kept before it carried its design says
    nothing here, since nothing can be told."""
    plan, design = study.get("plan", {}), study.get("plan", {}).get("design")
    if not design:
        return []
    out = []
    for key, what in (("kv", "KV cache arms"), ("corrections", "corrections"), ("seeds", "seeds")):
        left = [str(x) for x in design[key] if x not in plan.get(key, [])]
        if left:
            out.append(f"{what} not run: {', '.join(left)}")
    if plan.get("steps") != design.get("steps"):
        out.append(f"{plan.get('steps')} steps where the design has {design.get('steps')}")
    have = {(t["kv"], t["correction"], s) for t in study.get("table", []) for s in t.get("seeds", [])}
    gaps = [f"{kv}/{corr} seed {s}" for s in plan.get("seeds", []) for kv in plan.get("kv", [])
            for corr in plan.get("corrections", []) if (kv, corr, s) not in have]
    if gaps:
        out.append("runs of the arms above that are missing: " + ", ".join(gaps))
    unfinished = [f"{r['kv']}/{r['correction']} seed {r['seed']} ({r['status']})"
                  for r in study.get("runs", []) if r.get("status") != "done"]
    if unfinished:
        out.append("runs that did not finish (counted as collapses): " + ", ".join(unfinished))
    return out


def fp8_section(study: dict[str, Any]) -> str:
    """RESULTS.md's "FP8 KV cache study": one line per (KV cache, correction) arm, over seeds; what was
    run, and what a partial study leaves out."""
    plan, rows = study.get("plan", {}), []
    for t in study.get("table", []):
        evals = None if t.get("eval_avg_mean") is None else 100 * t["eval_avg_mean"]
        eval_sd = None if t.get("eval_avg_sd") is None else 100 * t["eval_avg_sd"]
        seeds = t.get("seeds", [])
        rows.append([t["kv"], t["correction"], " ".join(str(x) for x in seeds), num(t.get("mismatch_abs_logp"), ".5f"),
                     num(t.get("icepop_masked_frac"), ".4f"), mean_sd(evals, eval_sd, ".1f"),
                     f"{t['collapsed']} of {len(seeds)}", num(t.get("wall_s_mean"), ".0f"),
                     " ".join(c[:7] for c in t.get("commits", [])) or "-"])
    ran = (f"Run: KV cache {', '.join(plan.get('kv', [])) or '-'}; corrections "
           f"{', '.join(plan.get('corrections', [])) or '-'}; seeds {', '.join(map(str, plan.get('seeds', []))) or '-'}; "
           f"{plan.get('steps', '-')} steps each.")
    missing = _fp8_missing(study)
    design = plan.get("design", {})
    partial = (f" Partial: the design is KV cache {', '.join(design['kv'])} x corrections "
               f"{', '.join(design['corrections'])} x seeds {', '.join(map(str, design['seeds']))} at "
               f"{design['steps']} steps; {'; '.join(missing)}. The rows are not the full study's."
               if missing else "")
    intro = (
        "What an FP8 KV cache in the rollout does to the train/inference mismatch and to training, with and "
        "without its corrections: recipes/tiny_rl.yaml from the tiny SFT model with the KV cache bf16 "
        "(`rollout.kv_cache_dtype=auto`), fp8_unit (fp8_e4m3 with unit scales, SGLang without calibration) or "
        "fp8_calibrated (fp8_e4m3, scales calibrated after every push), and the correction none, tis, icepop or "
        "m2po (`rl.icepop.mode` off, tis, icepop, m2po). " + ran + partial + " Mismatch and IcePop-masked share "
        "(the tokens outside IcePop's band, whatever the correction): means over every step and seed. Held-out: "
        "the final avg@8 on tiny-arith eval, percent (± sd across seeds). Wall-clock: the RL loop's seconds per "
        f"run (step_wall_s summed), mean over seeds. Collapse: {study.get('collapse_rule', '-')}."
        + (f" Note: {plan['note']}." if plan.get("note") else "")
        + (f" Figure: [{study['figure']}]({study['figure']})." if study.get("figure") else "")
        + " `make fp8-study` reruns it.")
    out = "## FP8 KV cache study\n\n" + wrapped(intro) + "\n" + table(FP8_HEADER, rows)
    if study.get("figure"):
        out += f"\n![mismatch and train accuracy per KV cache, against steps and wall-clock]({study['figure']})\n"
    return out


LORA_HEADER = ["arm", "lr", "seeds", "held-out avg@8 (min-max)", "final train accuracy", "bytes per push",
               "s per step", "collapsed", "commit"]


def _lora_missing(study: dict[str, Any]) -> list[str]:
    """The design's runs the table lacks, and runs that did not finish: empty for a complete study."""
    plan, design = study.get("plan", {}), study.get("plan", {}).get("design", {})
    have = {(t["arm"], t["lr_scale"], s) for t in study.get("table", []) for s in t.get("seeds", [])}
    gaps = [f"{arm} lr x{scale} seed {s}" for s in design.get("seeds", []) for scale in design.get("lr_scales", [])
            for arm in design.get("arms", []) if (arm, scale, s) not in have]
    out = [f"not run: {', '.join(gaps)}"] if gaps else []
    if design and plan.get("steps") != design.get("steps"):
        out.append(f"{plan.get('steps')} steps where the design has {design.get('steps')}")
    unfinished = [f"{r['arm']} lr x{r['lr_scale']} seed {r['seed']} ({r['status']})"
                  for r in study.get("runs", []) if r.get("status") != "done"]
    if unfinished:
        out.append("did not finish (counted as collapses): " + ", ".join(unfinished))
    return out


def lora_section(study: dict[str, Any]) -> str:
    """RESULTS.md's "LoRA study": one line per (arm, learning rate), over seeds."""
    plan, rows = study.get("plan", {}), []
    for t in study.get("table", []):
        pct = {k: None if t.get(k) is None else 100 * t[k] for k in ("eval_avg_mean", "eval_avg_sd", "eval_avg_min",
                                                                      "eval_avg_max")}
        spread = "" if pct["eval_avg_min"] is None else f" ({pct['eval_avg_min']:.1f}-{pct['eval_avg_max']:.1f})"
        arm = "full fine-tuning" if not t["rank"] else f"LoRA rank {t['rank']}"
        rows.append([arm, f"{t['lr']:g}", " ".join(str(x) for x in t.get("seeds", [])),
                     mean_sd(pct["eval_avg_mean"], pct["eval_avg_sd"], ".1f") + spread,
                     num(t.get("accuracy_final"), ".3f"), "-" if t.get("push_bytes") is None else f"{t['push_bytes']:,}",
                     num(t.get("step_s"), ".2f"), f"{t['collapsed']} of {len(t.get('seeds', []))}",
                     " ".join(c[:7] for c in t.get("commits", [])) or "-"])
    missing = _lora_missing(study)
    intro = (
        "LoRA against full fine-tuning in RL: recipes/tiny_rl.yaml from the tiny SFT model with "
        "`trainer.lora.rank` 0 (full), 1, 8 or 32 on every linear layer of the blocks (alpha 32), each over "
        f"the learning rates the table lists (scripts/lora_study.py's sweep); {plan.get('steps', '-')} steps, the "
        "seeds each row names. Held-out: the final avg@8 on tiny-arith eval, percent "
        "(± sd across seeds, min-max). Final train accuracy: the mean of the last steps. Bytes per push: what one "
        "push to SGLang carries (the adapter under LoRA, the whole model otherwise; the in-process engine the "
        "study ran on takes merged weights). Seconds per step: the RL loop's, the median of each run's steps, mean over seeds (taken on a machine "
        "running other work: compare within a row's seeds with care)."
        + (f" Partial: {'; '.join(missing)}. The rows are not the full study's." if missing else "")
        + (f" Note: {plan['note']}." if plan.get("note") else "")
        + " `make lora-study` reruns it.")
    out = "## LoRA study\n\n" + wrapped(intro) + "\n" + table(LORA_HEADER, rows)
    if study.get("figure"):
        out += f"\n![train accuracy per step, full fine-tuning and LoRA ranks, at each learning rate]({study['figure']})\n"
    return out
