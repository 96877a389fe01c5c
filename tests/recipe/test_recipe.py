import subprocess
import sys

import pytest

from rlrecipe.recipe.base import RecipeError
from rlrecipe.recipe.schema import load_recipe
from tests.conftest import REPO
from tests.helpers import recipe_changes

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def test_there_are_shipped_recipes():
    names = {p.name for p in SHIPPED}
    assert {"tiny_sft.yaml", "tiny_rl.yaml", "7b_boba.yaml", "32b_200.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    loaded = load_recipe(path)
    assert len(loaded.sha256) == 64
    # each shipped recipe documents itself in a header
    head = path.read_text().splitlines()[:8]
    assert any(line.startswith("# Hardware") for line in head), "header must state the hardware"
    assert any(line.startswith("# Command") for line in head), "header must state the command"


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


BASE = "run: {name: t}\nmodel: {tiny: {}}\n"


def test_unknown_key_names_path_and_field(tmp_path):
    p = write(tmp_path, BASE + "rl:\n  icepop:\n    alpah: 0.3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(p)
    assert str(err.value) == f"{p}: rl.icepop.alpah: unknown key; did you mean 'alpha'?"


def test_wrong_type_names_field_and_value(tmp_path):
    p = write(tmp_path, BASE + "rl: {steps: many}\n")
    with pytest.raises(RecipeError, match=r"rl\.steps: .*integer.*'many'"):
        load_recipe(p)


def test_cross_field_check(tmp_path):
    p = write(tmp_path, BASE + "rl: {icepop: {alpha: 5, beta: 2}}\n")
    with pytest.raises(RecipeError, match="alpha .* must be below beta"):
        load_recipe(p)


def test_missing_data_file_is_reported(tmp_path):
    p = write(tmp_path, BASE + f"data: {{train: {tmp_path}/nope.jsonl}}\n")
    with pytest.raises(RecipeError, match=r"data\.train: file not found"):
        load_recipe(p)


def test_overrides_are_typed_and_change_the_hash(tmp_path):
    p = write(tmp_path, BASE)
    base = load_recipe(p)
    over = load_recipe(p, ["rl.steps=7", "rl.icepop.beta=3.5", "rollout.urls=[a, b]"])
    assert over.recipe.rl.steps == 7 and over.recipe.rl.icepop.beta == 3.5
    assert over.recipe.rollout.urls == ["a", "b"]
    assert over.sha256 != base.sha256
    # an override to the default value is the same resolved recipe: same hash
    assert load_recipe(p, ["rl.steps=100"]).sha256 == base.sha256
    with pytest.raises(RecipeError, match=r"rl\.steps"):
        load_recipe(p, ["rl.steps=lots"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(p, ["rl.steps"])


def test_experiment_hash_ignores_only_seed_name_and_output_dir(tmp_path):
    base = load_recipe(write(tmp_path, BASE)).recipe
    reseeded = load_recipe(write(tmp_path, BASE), ["run.seed=9", "run.name=other", "run.output_dir=elsewhere"]).recipe
    changed = load_recipe(write(tmp_path, BASE), ["run.seed=9", "trainer.lr=0.5"]).recipe
    assert reseeded.sha256() != base.sha256() and reseeded.experiment_sha256() == base.experiment_sha256()
    assert changed.experiment_sha256() != base.experiment_sha256()


def test_hash_ignores_yaml_formatting(tmp_path):
    a = write(tmp_path, BASE + "rl: {steps: 5}\n")
    b = tmp_path / "b.yaml"
    b.write_text("# comment\nrl:\n  steps: 5\nmodel:\n  tiny: {}\nrun:\n  name: t\n")
    assert load_recipe(a).sha256 == load_recipe(b).sha256


def test_cli_validate_broken_recipe_one_line_exit_2(tmp_path):
    p = write(tmp_path, BASE + "trainer: {lr: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "validate", str(p)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "trainer.lr" in lines[0] and "Traceback" not in proc.stderr


def test_cli_validate_all_shipped(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", "validate", *map(str, SHIPPED)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok ") == len(SHIPPED)


def test_icepop_c3po_recipe_changes_only_what_it_claims():
    changed = set(recipe_changes("7b_boba.yaml", "7b_boba_icepop_c3po.yaml"))
    assert changed == {"run.name", "rl.icepop.mode", "rl.c3po.enabled"}


def test_release_numbers_match_areal_v02_configs():
    # Read by hand from inclusionAI/AReaL v0.2.0 examples/configs/ (cited in each recipe header).
    sft = load_recipe(REPO / "recipes" / "32b_200.yaml").recipe
    assert (sft.sft.epochs, sft.sft.batch_size, sft.sft.max_length) == (200, 64, 32768)
    assert (sft.trainer.nodes * sft.trainer.nproc, sft.trainer.lr, sft.trainer.warmup_ratio) == (128, 1e-5, 0.03)
    assert (sft.trainer.weight_decay, sft.trainer.adam_eps, sft.model.dtype) == (0.1, 1e-5, "bfloat16")
    assert sft.model.revision == "711ad2ea6aa40cfca18895e8aca02ab92df1a746"
    assert sft.data.prompt_template == "raw"
    rl = load_recipe(REPO / "recipes" / "7b_boba.yaml").recipe
    assert (rl.model.dtype, rl.rollout.dtype, rl.trainer.bf16_autocast) == ("float16", "float16", False)
    assert (rl.trainer.warmup_ratio, rl.rl.steps, rl.data.max_prompt_tokens) == (0.001, 400, 1024)
    assert (rl.eval.temperature, rl.eval.top_p, rl.eval.n_samples) == (1.0, 0.95, 32)
    assert (rl.rl.early_stop_imp_ratio, rl.rl.kl_coef, rl.rl.ppo_minibatches) == (5.0, 0.0, 4)


def test_lora_dropout_is_refused_for_rl_and_kept_for_sft():
    # RL's ratio compares the trained policy with log-probs taken without dropout: on-policy it must be 1
    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["trainer.lora.rank=8", "trainer.lora.dropout=0.3"])
    assert len(str(err.value).splitlines()) == 1 and "trainer.lora.dropout: 0.3" in str(err.value)
    load_recipe(REPO / "recipes" / "tiny_rl.yaml", ["trainer.lora.rank=8"])
    sft = load_recipe(REPO / "recipes" / "tiny_sft.yaml", ["trainer.lora.rank=8", "trainer.lora.dropout=0.3"])
    assert sft.recipe.trainer.lora.dropout == 0.3
    # a recipe without an rl: section run by `rlrecipe rl` is refused before its run directory is made
    from rlrecipe.checks.preflight import check_rl_lora

    check_rl_lora(sft, "sft")
    with pytest.raises(RecipeError, match=r"tiny_sft.yaml: trainer.lora.dropout: 0.3"):
        check_rl_lora(sft, "rl")


@pytest.mark.parametrize("path", [p for p in SHIPPED if "launch_cmd" in p.read_text()], ids=lambda p: p.name)
def test_shipped_launch_cmds_take_the_lora_flags_and_none_without_lora(path):
    from rlrecipe.recipe.systems import LoraSection
    from rlrecipe.rollout.sglang.lora import launch_args
    from rlrecipe.rollout.sglang.server import server_specs

    def cmd(overrides):
        ro = load_recipe(path, overrides).recipe
        return server_specs("m", ro.rollout.sglang, [0], dtype="float32", seed=0,
                            template=ro.rollout.sglang.launch_cmd, lora_args=launch_args(ro.trainer.lora))[0].cmd

    lora = cmd(["trainer.lora.rank=8", "rollout.sglang.weight_sync=disk"])
    assert lora[lora.index("--enable-lora"):][:3] == ["--enable-lora", "--max-lora-rank", "8"]
    plain = cmd([])
    assert "--enable-lora" not in plain and not any("{" in a for a in plain)
    assert [a for a in lora if a not in launch_args(LoraSection(rank=8))] == plain


def test_a_lora_rl_launch_cmd_without_its_placeholder_is_refused(tmp_path):
    sglang = ("rollout: {engine: sglang, sglang: {launch_cmd: [rlrecipe, serve, '{model}', --port, '{port}']}}\n")
    p = write(tmp_path, BASE + "rl: {steps: 5}\n" + sglang)
    load_recipe(p)  # without LoRA nothing is missing
    with pytest.raises(RecipeError) as err:
        load_recipe(p, ["trainer.lora.rank=8"])
    assert len(str(err.value).splitlines()) == 1 and "rollout.sglang.launch_cmd: no \"{lora_args}\"" in str(err.value)
