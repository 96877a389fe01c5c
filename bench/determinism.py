"""Do the same short runs give the same numbers under different CPU kernels, and at what cost?

Two machines "of the same kind" can dispatch torch to different kernels (AVX2 vs AVX-512, MKL's
code paths on AMD vs Intel), and float sums then round differently. One machine can reproduce
much of that: ATen's dispatch is chosen by ATEN_CPU_CAPABILITY (default, avx2, avx512) and MKL's
by MKL_CBWR (unset: the best for this CPU; COMPATIBLE: one path on any x86). This runs the same
short chain (a tiny model built from its config, tiny-arith data, SFT steps then RL steps, each
through the real `rlrecipe` CLI) once per setting and reports, against the first setting:
whether the SFT losses, the RL rewards and the final weights are bit-identical, the largest
relative difference of each step's loss, and each setting's wall time (a ratio, not a goal).

    python -m bench.determinism [--settings default,avx2,avx512] [--cbwr] [--out bench/determinism.json]

The golden-run test (tests/test_golden_run.py) pins the same chain's numbers with the tolerance
this measures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from rlrecipe.run.metrics_file import read_metrics

TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
        "max_position_embeddings": 256}


def chain_recipes(root: Path) -> tuple[Path, Path]:
    """A 12-step SFT of a tiny model from scratch, then 3 RL steps from it (synchronous rollout)."""
    data = root / "data"
    runs = root / "runs"
    sft = {"run": {"name": "golden-sft", "seed": 11, "output_dir": str(runs)}, "model": {"tiny": TINY},
           "data": {"train": str(data / "sft.jsonl"), "prompt_template": "plain"},
           "sft": {"max_steps": 12, "batch_size": 16, "save_every": 12, "max_length": 200},
           "trainer": {"lr": 3e-3, "lr_schedule": "constant", "max_tokens_per_microbatch": 1024},
           "eval": {"benchmarks": []}}
    rl = {"run": {"name": "golden-rl", "seed": 11, "output_dir": str(runs), "init_from": str(runs / "golden-sft" / "final")},
          "data": {"train": str(data / "rl.jsonl"), "prompt_template": "plain"},
          "rl": {"steps": 3, "prompts_per_step": 8, "samples_per_prompt": 4, "ppo_minibatches": 2, "save_every": 3,
                 "adv_norm": "none", "c3po": {"enabled": False}},
          "trainer": {"lr": 1e-3, "max_tokens_per_microbatch": 1024},
          "rollout": {"dtype": "float32", "max_new_tokens": 48, "max_batch": 32},
          "eval": {"benchmarks": []}}
    paths = []
    for name, spec in (("sft", sft), ("rl", rl)):
        p = root / f"{name}.yaml"
        p.write_text(yaml.safe_dump(spec, sort_keys=False))
        paths.append(p)
    return paths[0], paths[1]


def write_data(root: Path) -> None:
    from rlrecipe.data.tiny_arith import TinyArithConfig, write_tiny_arith

    write_tiny_arith(root / "data", TinyArithConfig(seed=0, n_sft=400, n_rl=64, n_eval=8, max_lines=3))


def _weights_sha(run_dir: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((run_dir / "final").glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


def run_chain(root: Path, env: dict[str, str]) -> dict:
    """SFT then RL in fresh processes under `env`; the numbers the golden test pins."""
    sft, rl = chain_recipes(root)
    if not (root / "data" / "sft.jsonl").exists():
        write_data(root)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    t0 = time.time()
    for recipe in (sft, rl):
        subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "sft" if recipe == sft else "rl", str(recipe),
                        "--overwrite"], check=True, env=full_env, capture_output=True)
    wall = time.time() - t0
    s, r = (read_metrics(root / "runs" / name / "metrics.jsonl") for name in ("golden-sft", "golden-rl"))
    return {"sft_loss": [x["loss"] for x in s], "rl_loss": [x["loss"] for x in r],
            "rl_reward": [x["reward_mean"] for x in r], "rl_tokens": [x["tokens_trained"] for x in r],
            "sft_weights": _weights_sha(root / "runs" / "golden-sft"),
            "rl_weights": _weights_sha(root / "runs" / "golden-rl"), "wall_s": wall}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(x), abs(y), 1e-12) for x, y in zip(a, b, strict=True)), default=0.0)


def compare(ref: dict, other: dict) -> dict:
    return {"sft_loss_identical": ref["sft_loss"] == other["sft_loss"],
            "sft_loss_max_rel": max_rel_diff(ref["sft_loss"], other["sft_loss"]),
            "sft_weights_identical": ref["sft_weights"] == other["sft_weights"],
            "rl_reward_identical": ref["rl_reward"] == other["rl_reward"],
            "rl_tokens_identical": ref["rl_tokens"] == other["rl_tokens"],
            "rl_loss_max_rel": max_rel_diff(ref["rl_loss"], other["rl_loss"]),
            "rl_weights_identical": ref["rl_weights"] == other["rl_weights"],
            "wall_ratio": other["wall_s"] / ref["wall_s"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default=",default,avx2,avx512",
                    help="ATEN_CPU_CAPABILITY values, the first the reference ('' = torch's choice)")
    ap.add_argument("--cbwr", action="store_true", help="also each setting with MKL_CBWR=COMPATIBLE")
    ap.add_argument("--repeat", action="store_true", help="run the first setting twice (same-machine repeatability)")
    ap.add_argument("--out", default="bench/determinism.json")
    ap.add_argument("--write-golden", metavar="PATH", help="also write the reference run and the tolerance the "
                    "golden-run test uses (tests/data/golden_run.json)")
    args = ap.parse_args(argv)
    settings = []
    for cap in args.settings.split(","):
        env = {"ATEN_CPU_CAPABILITY": cap} if cap else {}
        settings.append((cap or "torch's choice", env))
        if args.cbwr:
            settings.append(((cap or "torch's choice") + " + MKL_CBWR=COMPATIBLE", {**env, "MKL_CBWR": "COMPATIBLE"}))
    if args.repeat:
        settings.insert(1, (settings[0][0] + " (again)", settings[0][1]))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in settings:
            results[name] = run_chain(Path(tmp), env)
            print(f"{name}: SFT losses {results[name]['sft_loss'][:3]}..., RL rewards {results[name]['rl_reward']}, "
                  f"{results[name]['wall_s']:.1f}s", flush=True)
    ref_name = settings[0][0]
    table = {name: compare(results[ref_name], r) for name, r in results.items() if name != ref_name}
    print(f"\nagainst {ref_name}:")
    for name, c in table.items():
        print(f"  {name}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()))
    Path(args.out).write_text(json.dumps({"reference": ref_name, "runs": results, "against_reference": table}, indent=1))
    print(f"wrote {args.out}")
    if args.write_golden:
        write_golden(Path(args.write_golden), results[ref_name], table)


GOLDEN_MARGIN = 100  # the tolerance is this many times the largest difference measured across kernel paths


def write_golden(path: Path, ref: dict, table: dict) -> None:
    """The reference run's numbers and the relative tolerance its losses are checked with elsewhere:
    GOLDEN_MARGIN x the largest difference between kernel paths here (at least 1e-6), since
    another CPU's kernels differ from this one's at least as much as this one's differ among
    themselves, and differences grow over steps."""
    from rlrecipe.run.env import cpu_record

    worst = max([c["sft_loss_max_rel"] for c in table.values()] + [c["rl_loss_max_rel"] for c in table.values()]
                + [0.0])
    golden = {"what": "bench/determinism.py's chain (12 SFT steps of a tiny model from scratch, then 3 RL steps)",
              "command": "python -m bench.determinism --cbwr --write-golden tests/data/golden_run.json",
              "cpu": cpu_record(), "torch": __import__("torch").__version__,
              "largest_rel_diff_across_kernels": worst, "tolerance_rel": max(GOLDEN_MARGIN * worst, 1e-6),
              **{k: ref[k] for k in ("sft_loss", "rl_loss", "rl_reward", "rl_tokens")}}
    path.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {path} (relative tolerance {golden['tolerance_rel']:.2g})")


if __name__ == "__main__":
    main()
