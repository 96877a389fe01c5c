"""`rlrecipe fit`: layouts for the GPUs at hand, each one the plan accepts, training unchanged."""

from __future__ import annotations

import math
import subprocess
import sys
from statistics import NormalDist

import pytest
from rlrecipe.cli.app import app
from typer.testing import CliRunner

from rlrecipe.checks.fit import fit
from rlrecipe.checks.fit_layout import Machine
from rlrecipe.checks.fit_search import FIT_MARGIN, Search
from rlrecipe.checks.model_dims import GIB, model_dims
from rlrecipe.checks.plan import plan
from rlrecipe.checks.step_time import Lengths, Rates, rollout_step, training_step
from rlrecipe.recipe.schema import load_recipe
from tests.conftest import REPO
from tests.helpers import flat_recipe

SOURCE = "recipes/7b_boba.yaml"
# The machines issue 45 names: (GPUs per node, nodes, GiB per GPU)
MACHINES = {"8x80": (8, 1, 80), "8x40": (8, 1, 40), "2x8x80": (8, 2, 80), "4x80": (4, 1, 80)}
SHIPPED = {"7b_boba_8x80gb.yaml": ("7b_boba.yaml", 80), "7b_boba_8x40gb.yaml": ("7b_boba.yaml", 40),
           "7b_boba_icepop_c3po_8x80gb.yaml": ("7b_boba_icepop_c3po.yaml", 80),
           "7b_boba_icepop_c3po_8x40gb.yaml": ("7b_boba_icepop_c3po.yaml", 40)}


def _cli(args: list[str]):
    return subprocess.run([sys.executable, "-m", "rlrecipe.cli.app", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _fit_to(tmp_path, monkeypatch, source: str, gpus: int, nodes: int, mem: float, name: str):
    monkeypatch.chdir(REPO)  # the header names the source as given, relative to the repository
    out = tmp_path / name
    result = CliRunner().invoke(app, ["fit", source, "--gpus", str(gpus), "--nodes", str(nodes),
                                      "--gpu-memory", str(mem), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.mark.parametrize("machine", MACHINES, ids=str)
def test_fit_writes_a_layout_the_plan_and_validate_accept(machine, tmp_path, monkeypatch):
    gpus, nodes, mem = MACHINES[machine]
    out, printed = _fit_to(tmp_path, monkeypatch, SOURCE, gpus, nodes, mem, f"7b_boba_{machine}.yaml")
    assert ("layouts fit" in printed or "1 layout fits" in printed) and f"wrote {out}" in " ".join(printed.split())
    fitted, source = load_recipe(out).recipe, load_recipe(REPO / SOURCE).recipe
    assert fitted.algorithm_sha256() == source.algorithm_sha256() and fitted.sha256() != source.sha256()
    # what is trained, field by field, not only through the hash
    for section in ("model", "data", "rl", "eval"):
        assert getattr(fitted, section) == getattr(source, section), section
    tr, s = fitted.trainer, fitted.rollout.sglang
    assert (tr.lr, tr.adam_betas, tr.weight_decay, tr.grad_clip) == (source.trainer.lr, source.trainer.adam_betas,
                                                                      source.trainer.weight_decay, source.trainer.grad_clip)
    # every GPU is used: once by a training rank or a server, or colocated by both
    server_gpus = s.num_servers * s.tp_size * s.dp_size
    if fitted.rollout.colocate:
        assert tr.nproc * tr.nodes == server_gpus == gpus * nodes
        # the push fit costed: by handle at the assumed and measured rates (over disk the export and loads
        # cost more, 8 servers' bodies by value more still)
        assert s.weight_sync == fit(load_recipe(REPO / SOURCE), Machine(gpus, nodes, mem)).layouts[0].push == "ipc"
    else:
        assert tr.nproc * tr.nodes + server_gpus == gpus * nodes
    if nodes == 1:
        assert tr.nodes == 1 and s.nodes == 1 and s.host == "127.0.0.1"
        # the run's own check before it launches servers beside the trainer: exactly the node's GPUs
        from rlrecipe.core.errors import UserError
        from rlrecipe.rollout.sglang.server import check_gpus, trainer_gpus_on_node

        beside = 0 if fitted.rollout.colocate else trainer_gpus_on_node(tr)
        check_gpus(s, visible=gpus, trainer_gpus=beside)
        with pytest.raises(UserError):
            check_gpus(s, visible=gpus - 1, trainer_gpus=beside)
    else:
        assert tr.nodes + s.nodes == nodes and tr.nproc == gpus and s.num_servers * s.tp_size == s.nodes * gpus
    assert tr.gpu_memory_gib == mem
    # the plan accepts it, with the margin fit promises
    _, _, budgets = plan(load_recipe(out))
    train = next(b for b in budgets if b.side == "train")
    assert all(b.fits for b in budgets) and train.total <= (1 - FIT_MARGIN) * mem * GIB
    assert s.mem_fraction_static * mem * GIB == pytest.approx(next(b for b in budgets if b.side == "rollout").capacity)
    for command in (["plan", str(out)], ["validate", str(out)]):
        proc = _cli(command)
        assert proc.returncode == 0, proc.stderr
    assert source.algorithm_sha256() in _cli(["validate", str(out)]).stdout


def test_fitted_header_says_what_changed_and_why(tmp_path, monkeypatch):
    out, _ = _fit_to(tmp_path, monkeypatch, SOURCE, 8, 1, 40, "7b_boba_8x40gb.yaml")
    text = out.read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any(ln.startswith("# Hardware: 8 x 40 GB") for ln in header[:8])
    assert any(ln.startswith("# Command:") for ln in header[:8])
    fitted, source = flat_recipe(str(out)), flat_recipe("7b_boba.yaml")
    changed = {k for k in source if source[k] != fitted[k]}
    assert "rollout.colocate" in changed and "trainer.gpu_memory_gib" in changed
    listed = " ".join(ln.lstrip("#").strip() for ln in header)  # wrapped lines joined again
    for key in changed:  # every changed field is named in the header, with its old and new value
        assert f"{key} {source[key]} -> {fitted[key]}" in listed, key
    # the reason for a memory change is the plan's figure without it
    assert "trainer.offload_optimizer False -> True" in listed and "over 38.0" in listed


def test_shipped_fitted_recipes_are_what_fit_writes_today(tmp_path, monkeypatch):
    # the same relative paths as the shipped headers name, in a copy of recipes/
    (tmp_path / "recipes").mkdir()
    for source in {source for source, _ in SHIPPED.values()}:
        (tmp_path / "recipes" / source).write_text((REPO / "recipes" / source).read_text())
    monkeypatch.chdir(tmp_path)
    for name, (source, mem) in SHIPPED.items():
        shipped = REPO / "recipes" / name
        result = CliRunner().invoke(app, ["fit", f"recipes/{source}", "--gpus", "8", "--gpu-memory", str(mem),
                                          "--out", f"recipes/{name}"])
        assert result.exit_code == 0, result.output
        regenerated = (tmp_path / "recipes" / name).read_text()
        assert regenerated == shipped.read_text(), f"{name}: regenerate with its '# Generated by:' line"
        assert load_recipe(shipped).recipe.algorithm_sha256() == load_recipe(REPO / "recipes" / source).recipe.algorithm_sha256()


# The colocated rank's least on one card (ZeRO-3, optimizer and parameters offloaded, 28k-token
# micro-batches), by hand from the plan's parts: what ZeRO-3 keeps of the weights 1.96 GiB, activations
# 5.36, the head's backward 4.30 beyond them, one layer's backward 3.80 beyond that, the reduce bucket 0.93,
# the released SGLang's 6, the reserve 1 GiB + 5% of 24: 24.5. Before the optimizer step was counted on the
# host under ZeRO-Offload, its fp32 temporary (4 bytes x 7.616B parameters, 28.4 GiB) was the peak: 39.5.
ONE_CARD_LEAST_24 = 1.96 + 5.36 + 4.30 + 3.80 + 0.93 + 6 + (1 + 0.05 * 24)


def test_no_fit_on_one_card_is_one_line_with_the_colocated_numbers_and_a_machine_that_fits():
    proc = _cli(["fit", SOURCE, "--gpus", "1", "--gpu-memory", "24"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    # the least training phase of a colocated rank (ZeRO-3, with what the released SGLang keeps)
    loaded = load_recipe(REPO / SOURCE)
    search = Search(loaded, Machine(1, 1, 24))
    least = min(search.train_options(1, 1, colocated=True), key=lambda o: o.peak)
    usable = 0.95 * 24
    assert least.peak / GIB > usable
    assert least.peak / GIB == pytest.approx(ONE_CARD_LEAST_24, abs=0.02)
    assert (f"does not fit 1 x 24 GB: 7.6B colocated on 1 x 24 GB: the training phase needs "
            f"{least.peak / GIB:.1f} GiB per GPU > {usable:.1f} usable") in lines[0]
    assert lines[0].endswith("Smallest that fits: 2 x 24 GB, or 1 x 40 GB.")
    # the machine it names fits, and so does one 40 GB GPU, colocated (26.3 GiB, the reserve 1 GiB + 5% of 40)
    assert fit(loaded, Machine(2, 1, 24)).layouts
    one_40 = fit(loaded, Machine(1, 1, 40)).layouts[0]
    assert one_40.colocated and one_40.train.peak / GIB == pytest.approx(ONE_CARD_LEAST_24 + 0.8 + 0.97, abs=0.05)


def test_when_training_fits_no_split_the_refusal_says_by_how_much():
    loaded = load_recipe(REPO / SOURCE)
    refused = fit(loaded, Machine(2, 1, 16)).refusal
    # one GPU trains at most; the plan's least for one rank, against 95% of 16 GiB: the colocated parts
    # above without SGLang's 6 GiB, the reserve 1 GiB + 5% of 16
    search = Search(loaded, Machine(2, 1, 16))
    least = min(o.peak for o in search.train_options(1, 1)) / GIB
    assert least == pytest.approx(1.96 + 5.36 + 4.30 + 3.80 + 0.93 + 1.8, abs=0.02)
    assert f"training does not fit: at least {least:.1f} GiB per GPU" in refused and "of 15.2 GiB usable" in refused
    # and colocated, every GPU a rank, by how much: the same and the released SGLang's 6 GiB (ZeRO-3's
    # partition of the weights is offloaded, so a second rank saves nothing of it)
    shared = min(search.train_options(2, 1, colocated=True), key=lambda o: o.peak).peak / GIB
    assert shared == pytest.approx(least + 6, abs=0.02)
    assert f"colocated on 2 x 16 GB: the training phase needs {shared:.1f} GiB per GPU > 15.2 usable" in refused
    assert refused.endswith("Smallest that fits: 1 x 40 GB.")


def test_host_memory_limits_the_layouts():
    loaded = load_recipe(REPO / SOURCE)
    free = fit(loaded, Machine(8, 1, 40))
    needed = min(lay.train.host for lay in free.layouts) / GIB
    assert fit(loaded, Machine(8, 1, 40, host_memory_gib=math.ceil(needed))).layouts
    refused = fit(loaded, Machine(8, 1, 40, host_memory_gib=64))
    assert refused.refusal and "host memory does not fit" in refused.refusal


@pytest.mark.parametrize("args, said", [
    (["--gpus", "0"], "--gpus 0"),
    (["--gpus", "8", "--gpu-memory", "-3"], "--gpu-memory -3"),
    (["--gpus", "8", "--nodes", "0"], "--nodes 0"),
    (["--gpus", "8", "--host-memory", "-1"], "--host-memory -1"),
])
def test_bad_arguments_get_one_line_and_exit_2(args, said):
    proc = _cli(["fit", SOURCE, *args])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0] and "Traceback" not in proc.stderr


def test_unknown_recipe_and_a_recipe_fit_cannot_lay_out():
    proc = _cli(["fit", "recipes/nope.yaml", "--gpus", "8"])
    assert proc.returncode == 2 and "recipe file not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli(["fit", "recipes/tiny_rl.yaml", "--gpus", "8"])
    assert proc.returncode == 2 and "DeepSpeed" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_overrides_of_the_source_are_fitted_and_named(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "short.yaml"
    result = CliRunner().invoke(app, ["fit", SOURCE, "--gpus", "8", "--set", "rl.steps=100", "--out", str(out)])
    assert result.exit_code == 0, result.output
    fitted = load_recipe(out).recipe
    assert fitted.rl.steps == 100
    assert fitted.algorithm_sha256() == load_recipe(REPO / SOURCE, ["rl.steps=100"]).recipe.algorithm_sha256()
    header = " ".join(ln.lstrip("#").strip() for ln in out.read_text().splitlines() if ln.startswith("#"))
    assert "--set rl.steps=100" in header and "h for its 100 steps" in header


def test_async_recipe_keeps_its_lag(tmp_path, monkeypatch):
    out, _ = _fit_to(tmp_path, monkeypatch, "recipes/7b_boba_async.yaml", 8, 2, 80, "async_2x8.yaml")
    fitted, source = load_recipe(out).recipe, load_recipe(REPO / "recipes/7b_boba_async.yaml").recipe
    assert fitted.rl.async_lag == source.rl.async_lag == 1  # not the default 0
    assert fitted.algorithm_sha256() == source.algorithm_sha256()


# -- the step-time model, against figures computed another way -------------------------------------------

def test_lengths_mean_is_the_capped_lognormal_mean():
    lengths = Lengths.assumed(27_648, 1024)
    mu, sigma, cap = math.log(10_000), math.hypot(0.4, 0.45), 27_648
    phi = NormalDist().cdf
    # E[min(X, c)] for log-normal X, in closed form
    exact = (math.exp(mu + sigma**2 / 2) * phi((math.log(cap) - mu - sigma**2) / sigma)
             + cap * (1 - phi((math.log(cap) - mu) / sigma)))
    assert lengths.mean == pytest.approx(exact, rel=5e-3)
    assert lengths.prompt == 512 and max(lengths.values) <= cap


def test_rates_at_7b_are_the_simulated_projections_fitted_model():
    """fit's closed forms and the simulator read one cost model (gpu_costs.py): at the simulator's trained
    sequence (256 prompt tokens and 10,000 of response) every rate is the same."""
    from bench.projection.rollout import H100_7B_FITTED as fitted

    loaded = load_recipe(REPO / SOURCE)
    rates = Rates.of(model_dims(loaded), "bfloat16", gradient_checkpointing=False, train_seq_len=256 + 10000)
    for name in ("step_s", "row_s", "ctx_s", "prefill_token_s", "train_token_s"):
        assert getattr(rates, name) == pytest.approx(getattr(fitted, name), rel=1e-9), name


def test_rollout_and_training_steps_by_hand():
    rates = Rates(step_s=1e-2, row_s=1e-4, ctx_s=1e-6, prefill_token_s=1e-3, train_token_s=1e-3)
    lengths = Lengths(max_new=100, prompt=10.0, values=(40.0, 60.0))  # mean 50, mean square 2600
    # C3PO++: 1,000 tokens on 2 engines, 4 rows each (pool 8), KV for far more
    r = rollout_step(rates, lengths, engines=2, tp=1, kv_tokens=10**6, rollouts=0, max_concurrency=64,
                     c3po_budget=1000, c3po_pool=8)
    per_token_context = 10 + 2600 / 100  # prompt + E[L^2] / (2 E[L])
    steps, generated = 500 / 4, 500
    assert r.trained_tokens == 1000 and r.rows_at_once == 4
    assert r.seconds == pytest.approx(1e-2 * steps + 1e-4 * generated + 1e-6 * generated * per_token_context
                                      + 1e-3 * 4 * per_token_context)
    # ZeRO-3 over 4 ranks on one node: compute, chunks, 3 model-sized collectives per micro-batch
    t = training_step(rates, _dims(), trained_tokens=8_000, ranks=4, nodes=1, dtype="float16", zero_stage=3,
                      offload_optimizer=False, offload_params=False, microbatch_tokens=1000, chunk_tokens=100,
                      minibatches=2)
    micro = math.ceil(2000 / 850)  # 2,000 tokens a rank, micro-batches filled to 85%
    n = _dims().params()
    assert t.parts["compute"] == pytest.approx(1e-3 * 2000)
    assert t.parts["ZeRO collectives"] == pytest.approx(3 * micro * 2 * n / 150e9)
    assert t.microbatches == math.ceil(micro / 2)


def _dims():
    from rlrecipe.checks.model_dims import ModelDims

    return ModelDims(vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tied=True)


def test_table_figures_follow_from_each_other():
    loaded = load_recipe(REPO / SOURCE)
    result = fit(loaded, Machine(8, 1, 80))
    search = Search(loaded, Machine(8, 1, 80))
    best = result.layouts[0]
    assert best.trained_tokens == pytest.approx(512 * 16 * search.lengths.mean)
    assert best.step_s == pytest.approx(best.rollout.time.seconds + best.train.time.seconds)  # synchronous
    assert best.hours == pytest.approx(best.step_s * 400 / 3600)
    assert [lay.s_per_mtoken for lay in result.layouts] == sorted(lay.s_per_mtoken for lay in result.layouts)
    # its training side is the fastest fitting option on its GPUs
    assert best.colocated  # every GPU both rolls out and trains: faster than any split here
    # (with the push into its servers, which the options share)
    push = search.pushes(best.rollout)[best.push]
    options = [o for o in search.train_options(best.train.ranks, 1, colocated=True, push_s=push) if search.train_fits(o)]
    assert best.train.time.seconds == min(o.time.seconds for o in options)


def test_readme_lists_each_shipped_fitted_recipe_with_its_projected_hours():
    import re

    readme = (REPO / "README.md").read_text()
    for name in [*SHIPPED, "1.5b_boba_icepop_c3po_lora_1x24gb.yaml", "7b_boba_icepop_c3po_lora_1x48gb.yaml"]:
        header = " ".join(ln.lstrip("#").strip() for ln in (REPO / "recipes" / name).read_text().splitlines()
                          if ln.startswith("#"))
        hours = int(re.search(r"Projected .*?, (\d+) h for its", header).group(1))
        row = next(ln for ln in readme.splitlines() if ln.startswith(f"| `recipes/{name}` |"))
        assert f"projected {hours:,} h" in row, name


def test_a_fitted_header_says_how_far_above_sglangs_assumed_outside_memory_the_layout_fits(tmp_path):
    """The headroom beyond SGLANG_OUTSIDE_POOL_GIB, by hand: colocated on 8 x 80 GB with a 0.9 pool, the
    rollout phase leaves 8 GiB outside the pool, less the assumed 6 and the offloaded trainer's 1.5: 0.5;
    the training phase has far more room (76 GiB usable), so the rollout phase decides."""
    loaded = load_recipe(REPO / SOURCE)
    search = Search(loaded, Machine(8, 1, 80))
    best = search.layouts()[0]
    assert best.colocated and best.rollout.mem_fraction == 0.9
    assert search.sglang_headroom_gib(best) == pytest.approx(0.1 * 80 - 6 - 1.5)
    assert (0.95 * 80 * GIB - best.train.peak) / GIB > 0.5
    # a split layout: the rollout GPUs' room outside the pool beyond the 6 GiB
    split = next(lay for lay in search.layouts() if not lay.colocated)
    assert search.sglang_headroom_gib(split) == pytest.approx((1 - split.rollout.mem_fraction) * 80 - 6)
    # the LoRA recipe on one 48 GB GPU: its training phase decides, 45.6 usable less the plan's peak
    lora = Search(load_recipe(REPO / "recipes/7b_boba_icepop_c3po_lora_1x48gb.yaml"), Machine(1, 1, 48))
    lay = lora.layouts()[0]
    assert lora.sglang_headroom_gib(lay) == pytest.approx((0.95 * 48 * GIB - lay.train.peak) / GIB)
    out = tmp_path / "fitted.yaml"
    result = CliRunner().invoke(app, ["fit", SOURCE, "--gpus", "8", "--gpu-memory", "80", "--out", str(out)])
    assert result.exit_code == 0, result.output
    header = " ".join(ln.lstrip("#").strip() for ln in out.read_text().splitlines() if ln.startswith("#"))
    assert "fits with 0.5 GiB to spare beyond the 6 GiB SGLang is assumed to keep" in header
    assert "holds while a server keeps at most 6.5 GiB there" in header
