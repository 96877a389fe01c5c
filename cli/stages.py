"""The stage commands. Each parses arguments, loads a recipe, and calls one library function."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlrecipe.core.errors import UserError

SetOpt = Annotated[list[str] | None, typer.Option("--set", help="dotted override, e.g. rl.steps=10")]
ResumeOpt = Annotated[bool, typer.Option(help="continue from the newest complete checkpoint")]
OverwriteOpt = Annotated[bool, typer.Option(help="start over, replacing this run's checkpoints, metrics and final "
                                                 "model (or another stage's run of the same name); they are kept "
                                                 "until the new run writes its first checkpoint")]
AdoptOpt = Annotated[bool, typer.Option(help="with --resume: resume from a checkpoint another experiment, seed or "
                                             "stage wrote, or whose state disagrees with its manifest's step")]


def _adopt(adopt: bool) -> None:
    if adopt:  # an environment variable, so that the ranks torchrun starts see it too
        import os

        from rlrecipe.run.checkpoints import ADOPT_ENV

        os.environ[ADOPT_ENV] = "1"


def _load(recipe: Path, overrides: list[str] | None):
    from rlrecipe.recipe.schema import load_recipe

    return load_recipe(recipe, overrides or [])


def relaunch_args(stage: str, loaded, resume: bool, overwrite: bool = False) -> list[str]:
    """This stage command as each rank runs it under torchrun (`--adopt-checkpoint` travels in the
    environment)."""
    args = ["-m", "rlrecipe.cli.app", stage, str(loaded.path)]
    for item in loaded.overrides:
        args += ["--set", item]
    return args + (["--resume"] if resume else []) + (["--overwrite"] if overwrite else [])


def _relaunch(stage: str, loaded, resume: bool, overwrite: bool) -> None:
    """Several DeepSpeed processes: run this command under torchrun and exit; else return."""
    from rlrecipe.train.launch import maybe_relaunch

    maybe_relaunch(loaded, relaunch_args(stage, loaded, resume, overwrite))


def validate(recipes: Annotated[list[Path], typer.Argument(help="recipe YAML files")],
             set_: SetOpt = None) -> None:
    """Load and type-check recipes; print each one's sha256, then its algorithm sha256 (what is trained,
    not where it runs: a recipe fitted to other GPUs keeps it)."""
    from rlrecipe.recipe.base import RecipeError
    from rlrecipe.recipe.schema import load_recipe

    failed = 0
    for path in recipes:
        try:
            loaded = load_recipe(path, set_ or [])
        except RecipeError as err:
            typer.echo(f"error: {err}", err=True)
            failed += 1
            continue
        typer.echo(f"ok  {loaded.sha256}  algorithm {loaded.recipe.algorithm_sha256()}  {path}")
    if failed:
        raise typer.Exit(2)


def sft(recipe: Path, set_: SetOpt = None, resume: ResumeOpt = False, overwrite: OverwriteOpt = False,
        adopt_checkpoint: AdoptOpt = False) -> None:
    """Supervised fine-tuning (distillation), loss on response tokens only."""
    loaded = _load(recipe, set_)
    _adopt(adopt_checkpoint)
    _relaunch("sft", loaded, resume, overwrite)
    # imported after the relaunch: a command that only starts torchrun never loads the stage (torch, DeepSpeed)
    from rlrecipe.stages.sft import run_sft

    run_sft(loaded, resume=resume, overwrite=overwrite)


def rl(recipe: Path, set_: SetOpt = None, resume: ResumeOpt = False, overwrite: OverwriteOpt = False,
       adopt_checkpoint: AdoptOpt = False) -> None:
    """Critic-free PPO with IcePop and C3PO++."""
    loaded = _load(recipe, set_)
    if loaded.recipe.rollout.engine == "sglang":  # before torch loads: see rlrecipe/core/threads.py
        from rlrecipe.core.threads import threaded_wait_policy

        threaded_wait_policy("an SGLang client beside the kernels")
    _adopt(adopt_checkpoint)
    _relaunch("rl", loaded, resume, overwrite)
    # imported after the relaunch: a command that only starts torchrun never loads the stage (torch, DeepSpeed)
    from rlrecipe.stages.rl import run_rl

    run_rl(loaded, resume=resume, overwrite=overwrite)


def eval_(recipe: Annotated[Path | None, typer.Argument(help="recipe; default: the latest run's own")] = None,
          model: Annotated[str | None, typer.Option(help="model dir; default: the run's final export")] = None,
          set_: SetOpt = None) -> None:
    """Evaluate avg@n / pass@k on the recipe's benchmarks; record results."""
    from rlrecipe.core.console import console
    from rlrecipe.stages.evaluate import run_eval

    for name, s in run_eval(recipe, model, set_ or []).items():
        shown = "  ".join(f"pass@{k}={v:.3f}" for k, v in s["pass_at_k"].items())
        console.print(f"[bold]{name}[/]: avg@{s['n']} = {s['avg']:.4f} ± {s['stderr']:.4f}  {shown}")


def results(json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
            write: Annotated[bool, typer.Option(help="regenerate RESULTS.md")] = True,
            record: Annotated[bool, typer.Option(help="keep this machine's results in results/, replacing "
                                                      "the kept ones of the same recipe, model and benchmark")] = False
            ) -> None:
    """Print evaluation results (and regenerate RESULTS.md from results/ and local runs)."""
    from rlrecipe.cli.results import results_command

    results_command(as_json=json_, write=write, record=record)


def serve(ctx: typer.Context, model: str, port: Annotated[int, typer.Option()] = 30000,
          host: Annotated[str, typer.Option()] = "127.0.0.1",
          dtype: Annotated[str, typer.Option()] = "float32",
          api_key: Annotated[str | None, typer.Option(envvar="SGLANG_API_KEY", show_envvar=True,
                                                      help="require `Authorization: Bearer KEY` on all "
                                                           "but /health (as SGLang's --api-key); give it "
                                                           "in the environment: any local user reads a "
                                                           "command line")] = None,
          context_length: Annotated[int | None, typer.Option(
              help="the context served (default: the model's max_position_embeddings); /server_info "
                   "states it only when given, as SGLang's --context-length")] = None,
          enable_memory_saver: Annotated[bool, typer.Option(
              "--enable-memory-saver", help="serve /release_memory_occupation and /resume_memory_occupation "
                                            "(a colocated layout); refused without it")] = False,
          kv_cache_dtype: Annotated[str, typer.Option(
              help="auto (the served dtype), fp8_e4m3 or fp8_e5m2: an FP8 KV cache with scales 1.0, as "
                   "SGLang's --kv-cache-dtype without calibrated scales")] = "auto",
          access_log: Annotated[bool, typer.Option(
              "--access-log", help="one line per request (client, method, path, status, User-Agent), as "
                                   "SGLang's access log")] = False,
          enable_lora: Annotated[bool, typer.Option(
              "--enable-lora", help="serve LoRA adapters (/load_lora_adapter, /load_lora_adapter_from_tensors, "
                                    "/unload_lora_adapter, /generate's lora_path), as SGLang's")] = False,
          max_lora_rank: Annotated[int, typer.Option(help="the largest adapter rank taken, as SGLang's")] = 0,
          max_loras_per_batch: Annotated[int, typer.Option(
              help="taken as SGLang's; every adapter loaded is served here")] = 8,
          lora_target_modules: Annotated[str | None, typer.Option(
              help="taken as SGLang's (names may follow, space-separated); the adapter's config decides "
                   "here")] = None,
          lora_backend: Annotated[str | None, typer.Option(help="taken as SGLang's; ignored")] = None) -> None:
    """Serve a model over the SGLang HTTP API subset, on the in-process engine (CPU)."""
    # SGLang's --lora-target-modules takes several names: the ones after the first arrive here
    if ctx.args and lora_target_modules is None:
        raise UserError(f"unexpected arguments: {' '.join(ctx.args)}")
    if enable_lora and max_lora_rank < 1:
        raise UserError("--enable-lora needs --max-lora-rank (at least 1), as SGLang without --lora-paths")
    del max_loras_per_batch, lora_backend
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port}: a TCP port is 0..65535")
    if context_length is not None and context_length < 2:
        raise UserError(f"--context-length {context_length}: at least 2 (a prompt token and a new one)")
    try:
        from rlrecipe.serve.http_server import serve_forever
    except ImportError as err:
        raise UserError(f"serve is not available: {err}") from None
    serve_forever(model, host=host, port=port, dtype=dtype, api_key=api_key, context_length=context_length,
                  enable_memory_saver=enable_memory_saver, kv_cache_dtype=kv_cache_dtype, access_log=access_log,
                  enable_lora=enable_lora, max_lora_rank=max_lora_rank)


def plot(runs: list[Path], out: Annotated[Path, typer.Option()] = Path("plots")) -> None:
    """PNG curves of runs' metrics, several runs overlaid."""
    from rlrecipe.eval.plot import plot_runs

    for path in plot_runs(runs, out):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    app.command()(validate)
    app.command()(sft)
    app.command()(rl)
    app.command(name="eval")(eval_)
    app.command()(results)
    # extra arguments: the further names of SGLang's multi-valued --lora-target-modules
    app.command(context_settings={"allow_extra_args": True})(serve)
    app.command()(plot)
