"""The bad-input matrix: every subcommand fed a damaged model, recipe, data file or option.

Each case runs the CLI in-process and must end in one clear error line naming the file, field
or line (a UserError, or `validate`'s exit 2), never a Python traceback, and never exit 0; the
few inputs that must be *accepted* are listed as such.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.core.errors import UserError
from tests.helpers import TINY_MODEL, write_tiny_data


# -- broken models -------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(model: Path) -> None:
    f = model / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _random_bytes(model: Path) -> None:
    f = model / "model.safetensors"
    f.write_bytes(os.urandom(f.stat().st_size))


def _no_tokenizer(model: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)


def _other_architecture(model: Path) -> None:
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 1, "n_head": 2,
        "vocab_size": 300, "n_positions": 64}))


BROKEN_MODELS = {
    "truncated safetensors": (_truncate, "model.safetensors"),
    "random-bytes safetensors": (_random_bytes, "model.safetensors"),
    "no tokenizer files": (_no_tokenizer, "tokenizer"),
    "config of another architecture": (_other_architecture, "config.json"),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_tiny_data(tmp_path_factory.mktemp("data") / "d", n=8)


@pytest.fixture(scope="module")
def broken_models(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for kind, (damage, _) in BROKEN_MODELS.items():
        model = _copy(tiny_model_dir, root / kind.replace(" ", "_"))
        damage(model)
        out[kind] = model
    return out


def recipe_dict(tmp: Path, data_dir: Path, **sections) -> dict:
    base = {
        "run": {"name": "r", "output_dir": str(tmp / "runs"), "seed": 3},
        "model": {"tiny": dict(TINY_MODEL)},
        "data": {"train": str(data_dir / "sft.jsonl"), "prompt_template": "plain"},
        "sft": {"batch_size": 2, "max_steps": 1, "save_every": 1, "max_length": 128},
        "rl": {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2, "ppo_minibatches": 1, "save_every": 1},
        "rollout": {"max_new_tokens": 16, "max_batch": 4},
        "eval": {"benchmarks": [{"name": "tiny", "path": str(data_dir / "eval.jsonl")}], "n_samples": 2,
                 "max_new_tokens": 16, "pass_k": [1, 2], "max_problems": 2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def write(tmp: Path, sections: dict, name: str = "r.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


# -- outcome of one CLI call ---------------------------------------------------------------------
def outcome(result) -> tuple[str, str]:
    """("clear", message) for one error line; ("traceback", ...) for any other exception; ("accepted", output)."""
    exc = result.exception
    if isinstance(exc, UserError):
        return "clear", str(exc)
    if exc is not None and not isinstance(exc, SystemExit):
        return "traceback", f"{type(exc).__name__}: {exc}"
    if result.exit_code == 0:
        return "accepted", result.output
    return "clear", " ".join(result.output.split())


def invoke(args: list[str]):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- the cases ----------------------------------------------------------------------------------
# Each returns the CLI arguments; `expect` is a piece of the one error line (None: must be accepted).
def _model_case(kind: str, command: str):
    def case(tmp, data, models):
        model = models[kind]
        if command == "sft":
            return ["sft", write(tmp, recipe_dict(tmp, data, model={"path": str(model)})), "--overwrite"]
        if command == "rl":
            rec = recipe_dict(tmp, data, data={"train": str(data / "rl.jsonl"), "prompt_template": "plain"})
            return ["rl", write(tmp, rec), "--set", f"run.init_from={model}"]
        if command == "eval":
            return ["eval", write(tmp, recipe_dict(tmp, data)), "--model", model]
        return ["serve", model, "--port", "0"]
    return case


def _recipe_case(section: str, value, command: str = "validate"):
    def case(tmp, data, models):
        return [command, write(tmp, recipe_dict(tmp, data, **{section: value}))]
    return case


def _raw_recipe(text: str, command: str = "validate"):
    def case(tmp, data, models):
        path = tmp / "r.yaml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return [command, path]
    return case


def _set_case(item: str):
    def case(tmp, data, models):
        return ["validate", write(tmp, recipe_dict(tmp, data)), "--set", item]
    return case


def _stage_set_case(stage: str, item: str):
    def case(tmp, data, models):
        rec = recipe_dict(tmp, data, data={"train": str(data / f"{stage}.jsonl"), "prompt_template": "plain"})
        return [stage, write(tmp, rec), "--set", item]
    return case


def _duplicate_ids(kind: str):
    def case(tmp, data, models):
        path = tmp / "d.jsonl"
        path.write_text('{"id": 7, "prompt": "p", "answers": ["1"]}\n{"id": 8, "prompt": "q", "answers": ["2"]}\n'
                        '{"id": "7", "prompt": "r", "answers": ["3"]}\n')
        if kind == "validate":
            return ["data", "validate", path, "--kind", "rl"]
        rec = recipe_dict(tmp, data, data={"train": str(path), "prompt_template": "plain"})
        return ["rl", write(tmp, rec)]
    return case


def _data_case(line: str, kind: str = "rl", prefix: bytes = b""):
    def case(tmp, data, models):
        path = tmp / "d.jsonl"
        path.write_bytes(prefix + line.encode() + b"\n")
        return ["data", "validate", path, "--kind", kind]
    return case


def _deep_json_data(tmp, data, models):
    path = tmp / "d.jsonl"
    path.write_text('{"id": 1, "prompt": "p", "answers": ' + "[" * 200_000 + "]" * 200_000 + "}\n")
    return ["data", "validate", path, "--kind", "rl"]


def _grade_line(line: str):
    def case(tmp, data, models):
        path = tmp / "g.jsonl"
        path.write_text(line + "\n")
        return ["grade", path]
    return case


def _import_deep_json(tmp, data, models):
    path = tmp / "raw.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return ["data", "import", path, "--as", "mine", "--kind", "rl", "--dest", tmp / "d"]


def _make_under_file(tmp, data, models):
    (tmp / "afile").write_text("x")
    return ["data", "make", "tiny-arith", "--out", tmp / "afile" / "sub", "--n-sft", 2, "--n-rl", 2, "--n-eval", 2]


def _plot_cut_line(tmp, data, models):
    run = tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    return ["plot", run, "--out", tmp / "plots"]


def _plan_case(section: str, value):
    def case(tmp, data, models):
        return ["plan", write(tmp, recipe_dict(tmp, data, **{section: value}))]
    return case


def _serve_port(tmp, data, models):
    return ["serve", models["good"], "--port", 70000]


def _checkpoint_weights_as_a_model(tmp, data, models):
    """run.init_from pointing into a checkpoint: weights and config, but no tokenizer (a realistic mistake)."""
    inner = tmp / "runs" / "sft" / "checkpoints" / "step_0000002" / "trainer" / "model"
    shutil.copytree(models["good"], inner)
    _no_tokenizer(inner)
    rec = recipe_dict(tmp, data, data={"train": str(data / "rl.jsonl"), "prompt_template": "plain"})
    return ["rl", write(tmp, rec), "--set", f"run.init_from={inner}"]


def _resume_never_ran(tmp, data, models):
    return ["sft", write(tmp, recipe_dict(tmp, data)), "--resume"]


def _eval_context(tmp, data, models):
    rec = recipe_dict(tmp, data, eval={"max_new_tokens": 100_000})
    return ["eval", write(tmp, rec), "--model", models["good"]]


CASES = {
    # models: sft, rl, eval and serve on each kind of broken model directory
    **{f"{cmd} {kind}": (_model_case(kind, cmd), hint) for kind, (_, hint) in BROKEN_MODELS.items()
       for cmd in ("sft", "rl", "eval", "serve")},
    "rl from a checkpoint's trainer/model": (_checkpoint_weights_as_a_model, "use the run's final/ or run:<name>"),
    # recipe numbers
    "lr .inf": (_recipe_case("trainer", {"lr": float("inf")}), "trainer.lr"),
    "lr nan via --set": (_set_case("trainer.lr=.nan"), "trainer.lr"),
    "reward_correct .inf": (_recipe_case("rl", {"reward_correct": float("inf")}), "rl.reward_correct"),
    "reward_wrong -.inf": (_recipe_case("rl", {"reward_wrong": float("-inf")}), "rl.reward_wrong"),
    "eval reference nan": (_recipe_case("eval", {"benchmarks": [{"name": "b", "path": "data/x.jsonl",
                                                                 "reference": {"avg": float("nan")}}]}),
                           "eval.benchmarks.0.reference"),
    "num_heads 0": (_recipe_case("model", {"tiny": {**TINY_MODEL, "num_heads": 0}}), "model.tiny.num_heads"),
    "hidden not divisible by heads": (_recipe_case("model", {"tiny": {**TINY_MODEL, "num_heads": 3}}),
                                      "model.tiny"),
    "kv heads not dividing heads": (_recipe_case("model", {"tiny": {**TINY_MODEL, "num_kv_heads": 3}}),
                                    "model.tiny"),
    "rl.steps 10^30": (_recipe_case("rl", {"steps": 10**30}), "rl.steps"),
    "seed 2^70": (_recipe_case("run", {"seed": 2**70}), "run.seed"),
    "seed -1": (_recipe_case("run", {"seed": -1}), "run.seed"),
    "pass_k above n_samples": (_recipe_case("eval", {"pass_k": [1, 64], "n_samples": 4}), "pass_k 64 is above"),
    "run name with control chars": (_recipe_case("run", {"name": "a\x07b"}), "run.name"),
    "run name of 100,000 chars": (_recipe_case("run", {"name": "n" * 100_000}), "run.name"),
    "duplicate section in recipe": (_raw_recipe("run: {name: t}\nmodel: {tiny: {}}\nrl: {steps: 3}\nrl: {steps: 5}\n"),
                                    "duplicate key"),
    "duplicate key in a section": (_raw_recipe("run: {name: t, name: u}\nmodel: {tiny: {}}\n"), "duplicate key"),
    "20,000-deep YAML": (_raw_recipe("run: {name: t}\nmodel: {tiny: {}}\nx: " + "[" * 20_000 + "]" * 20_000 + "\n"),
                         "r.yaml"),
    "200,000-deep JSON as a recipe": (_raw_recipe("run: {name: t}\nmodel: {tiny: {}}\nx: " + "[" * 200_000
                                                  + "]" * 200_000 + "\n"), "nested too deeply"),
    "20,000-deep --set value": (_set_case("rl.steps=" + "[" * 20_000), "rl.steps"),
    "gpu_memory_gib .inf in plan": (_plan_case("trainer", {"gpu_memory_gib": float("inf")}), "trainer.gpu_memory_gib"),
    "num_heads 0 in plan": (_plan_case("model", {"tiny": {**TINY_MODEL, "num_heads": 0}}), "model.tiny.num_heads"),
    # data files
    "5,000-digit integer in a data file": (_data_case('{"id": ' + "9" * 5000 + ', "prompt": "p", "answers": ["1"]}'),
                                           "d.jsonl:1"),
    "200,000-deep JSON in a data file": (_deep_json_data, "d.jsonl:1"),
    "200,000-deep JSON in a file to import": (_import_deep_json, "raw.json: JSON nested too deeply"),
    "200,000-deep JSON in a file to grade": (_grade_line('{"response": ' + "[" * 200_000 + "]" * 200_000 + "}"),
                                             "g.jsonl:1: JSON nested too deeply"),
    "5,000-digit integer in a file to grade": (_grade_line('{"response": "x", "answer": ' + "9" * 5000 + "}"),
                                               "g.jsonl:1: a number too long"),
    # other commands
    "data make --out under a file": (_make_under_file, "afile"),
    "plot with a cut last line": (_plot_cut_line, None),
    "serve --port 70000": (_serve_port, "--port"),
    "--resume of a run that never ran": (_resume_never_ran, "--resume"),
    "eval.max_new_tokens beyond the context": (_eval_context, "eval.max_new_tokens"),
    "--set run.name with a newline, sft": (_stage_set_case("sft", "run.name=a\nb"), "run.name"),
    "--set run.name with a newline, rl": (_stage_set_case("rl", "run.name=a\nb"), "run.name"),
    "--set run.name={a: 1}": (_set_case("run.name={a: 1}"), "run.name takes text, not a mapping"),
    "--set run.name=[a]": (_set_case("run.name=[a]"), "run.name takes text, not a list"),
    "duplicate ids in an RL data file": (_duplicate_ids("validate"), "d.jsonl:3: id '7' is already the id of line 1"),
    "duplicate ids in the data an RL run trains on": (_duplicate_ids("rl"), "d.jsonl:3"),
    # must be accepted
    "--set run.name=2024": (_set_case("run.name=2024"), None),
    "--set run.name='{a: 1}' quoted": (_set_case('run.name="{a: 1}"'), None),
    "--set run.name=off": (_set_case("run.name=off"), None),
    "BOM in a data file": (_data_case('{"id": 1, "prompt": "p", "answers": ["1"]}', prefix=b"\xef\xbb\xbf"), None),
    "BOM in a recipe": (_raw_recipe(b"\xef\xbb\xbfrun: {name: t}\nmodel: {tiny: {}}\n"), None),
}


@pytest.fixture
def models(broken_models, tiny_model_dir):
    return {**broken_models, "good": tiny_model_dir}


@pytest.fixture
def no_serving(monkeypatch):
    """`serve` on a model that loads would block: it returns instead, so acceptance shows as exit 0."""
    from rlrecipe.serve import http_server

    monkeypatch.setattr(http_server.Server, "serve_forever", lambda self, poll_interval=0.5: None)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_clear_line(tmp_path, data_dir, models, no_serving, case, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_args, expect = CASES[case]
    result = invoke(make_args(tmp_path, data_dir, models))
    kind, message = outcome(result)
    if expect is None and case != "plot with a cut last line":
        assert kind == "accepted", message
        return
    if case == "plot with a cut last line":  # the complete lines are plotted, the cut one is said
        assert kind == "accepted", message
        assert (tmp_path / "plots" / "loss.png").is_file()
        return
    assert kind == "clear", message
    assert "\n" not in message.strip() and "Traceback" not in message
    assert expect in message, message


def test_a_failed_start_leaves_no_lock_owner(tmp_path, data_dir, models):
    """A start that fails after taking the run directory's lock lets it go: no stale owner is left."""
    rec = recipe_dict(tmp_path, data_dir, sft={"max_steps": 1, "batch_size": 2, "max_length": 4})
    path = write(tmp_path, {**rec, "data": {"train": str(data_dir / "sft.jsonl"), "prompt_template": "plain"}})
    result = invoke(["sft", path])
    assert outcome(result)[0] == "clear"  # every row cut away by max_length: no usable SFT rows
    run_dir = tmp_path / "runs" / "r"
    assert run_dir.is_dir() and not (run_dir / ".lock.owner").exists()
