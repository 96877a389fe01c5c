"""Shared test helpers: tiny recipes written to tmp dirs, bounded subprocess runs."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
              "max_position_embeddings": 256}


def write_tiny_data(out: Path, n: int = 64) -> Path:
    from rlrecipe.data.tiny_arith import TinyArithConfig, write_tiny_arith

    write_tiny_arith(out, TinyArithConfig(seed=0, n_sft=n, n_rl=n, n_eval=8, max_lines=3))
    return out


def perturbed_copy(model_dir: Path, out: Path, seed: int, scale: float = 0.05) -> Path:
    """The HF model at `model_dir` with scale x N(0, 1) added to every weight, saved with its tokenizer at `out`."""
    import torch

    from rlrecipe.modeling import load_model, load_tokenizer

    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    load_tokenizer(model_dir).save_pretrained(out)
    return out


def write_recipe(path: Path, sections: dict) -> Path:
    path.write_text(yaml.safe_dump(sections, sort_keys=False))
    return path


def rl_recipe(tmp: Path, data: Path, init_from: str, **rl) -> dict:
    return {
        "run": {"name": "rl", "seed": 3, "output_dir": str(tmp / "runs"), "init_from": init_from},
        "data": {"train": str(data / "rl.jsonl"), "prompt_template": "plain"},
        # adv_norm none: the untrained model earns -5 everywhere, and raw rewards still move the weights
        "rl": {"steps": 4, "prompts_per_step": 4, "samples_per_prompt": 4, "ppo_minibatches": 2, "save_every": 1,
               "adv_norm": "none",
               "c3po": {"enabled": True, "token_budget": 300, "pool_capacity": 24, "max_staleness": 1}, **rl},
        "trainer": {"lr": 1e-3, "max_tokens_per_microbatch": 512},
        "rollout": {"dtype": "bfloat16", "max_new_tokens": 40, "max_batch": 24},
        "eval": {"benchmarks": [{"name": "tiny", "path": str(data / "eval.jsonl")}], "n_samples": 2,
                 "max_new_tokens": 40, "pass_k": [1, 2]},
    }


def kill_once_checkpointed(cmd: list[str], env: dict, checkpoint: Path, limit_s: float = 300) -> None:
    """Start a training command and SIGKILL it as soon as `checkpoint` exists (a crash at a random moment)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + limit_s
        while not checkpoint.exists():
            assert proc.poll() is None and time.time() < deadline, f"run ended before {checkpoint.name} existed"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


@contextlib.contextmanager
def beside(cmd: list[str], log: Path, timeout_s: float = 600, **popen):
    """`cmd` runs in the background while the block runs (its output in `log`); on leaving the block
    it is waited for and must have exited 0.

    For a kill-and-resume test's uninterrupted reference: each run takes one core (OMP_NUM_THREADS=1),
    so the reference beside the killed run and its resume takes the time of the longer, not of both."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)
    try:
        yield proc
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"timed out after {timeout_s}s: {cmd}\n{log.read_text(errors='replace')[-4000:]}")
        assert code == 0, f"failed ({code}): {cmd}\n{log.read_text(errors='replace')[-4000:]}"
    finally:
        stop_process(proc, wait_s=30)  # the block failed: the run goes too (SIGTERM first: it stops its servers)


def flat_recipe(name: str) -> dict:
    """A shipped recipe (recipes/NAME), resolved, as {"dotted.field": value}."""
    from rlrecipe.recipe.schema import load_recipe

    def flat(d: dict, prefix: str) -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(load_recipe(REPO / "recipes" / name).recipe.model_dump(mode="json"), "")


def recipe_changes(base: str, other: str) -> dict:
    """The fields whose resolved value differs between two shipped recipes, with `other`'s values."""
    a, b = flat_recipe(base), flat_recipe(other)
    return {k: b[k] for k in a if a[k] != b[k]}


def run_bounded(cmd: list[str], cwd: Path | None = None, timeout_s: float = 240) -> str:
    """Run a command in its own process group; kill the whole group on timeout; return its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    env.pop("RLRECIPE_LAUNCHED", None)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s}s: {cmd}\n{log[-4000:]}")
    assert proc.returncode == 0, f"failed ({proc.returncode}): {cmd}\n{log[-6000:]}"
    return log


R1_BOS, R1_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DATA = Path(__file__).parent / "data"


def build_r1_tokenizer(out: Path, chat_template: str | None = None):
    """A byte-level tokenizer shaped like DeepSeek-R1-Distill-Qwen's, saved and loaded back.

    One token per byte plus one merge (`\\n\\n`, so a token can span a prompt/answer boundary as
    real BPE merges do), the R1 special tokens, BOS added by `tokenizer(text)` (as the real
    tokenizer's post-processor does), and the R1 chat template from tests/data.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab[b2u[10] * 2] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(b2u[10], b2u[10])]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in (R1_BOS, R1_EOS, "<｜User｜>", "<｜Assistant｜>")])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    tk.post_processor = processors.TemplateProcessing(single=f"{R1_BOS} $A",
                                                      special_tokens=[(R1_BOS, tk.token_to_id(R1_BOS))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=R1_BOS, eos_token=R1_EOS, pad_token=R1_EOS)
    tok.chat_template = chat_template or (DATA / "r1_chat_template.jinja").read_text()
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@contextlib.contextmanager
def serving_in_thread(model_dir, **kwargs):
    """`rlrecipe serve`'s server on a free port in a thread of this process: (port, scheduler)."""
    import threading

    from rlrecipe.serve.http_server import make_server

    server, sched = make_server(model_dir, port=0, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], sched
    finally:
        server.shutdown()
        sched.stop()
        sched.thread.join(timeout=30)
        server.server_close()


def serve_process(model_dir: Path, log: Path, *flags: str, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`rlrecipe serve MODEL_DIR FLAGS` started on a free port, its output in `log`; returns once
    /health_generate answers 200 (the process and its URL). The caller stops it."""
    import requests

    from tests.rollout.test_sglang_client import free_port, rlrecipe_cmd

    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*rlrecipe_cmd(), "serve", str(model_dir), "--port", str(port), *flags],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        try:
            if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            time.sleep(0.2)


def resume_after_training(engine, version: int, *, state_dict: dict | None = None, model_dir=None) -> None:
    """What a colocated step (rl/colocate.py's push) asks of a released SGLang engine, without the
    trainer in between: weights allocated again, the push (by tensors, or the export from disk), the
    prefix cache flushed, the KV cache and CUDA graphs back, and only then the check (its probe
    generates)."""
    assert (state_dict is None) != (model_dir is None)
    engine.resume_memory(["weights"])
    if state_dict is not None:
        engine.update_weights_from_tensor(state_dict, version, verify=False)
    else:
        engine.update_weights_from_disk(model_dir, version, verify=False)
    engine.flush_cache()
    engine.resume_memory(["kv_cache", "cuda_graph"])
    engine.verify_push(version, state_dict=state_dict, model_dir=model_dir)


def stop_process(proc: subprocess.Popen, wait_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `wait_s`; nothing if it already exited."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=wait_s)
