"""What the weight fingerprint after each push costs (rollout/weights/check.py), against `rlrecipe serve`.

  python -m bench.weight_fingerprint

A random Qwen2 model of the given width at V = 152,064 is served by `rlrecipe serve` (CPU); the SGLang
engine pushes its weights several times from disk (an HF export, /update_weights_from_disk) and by
broadcast (gloo), and each push is followed by the fingerprint. Printed: seconds per push and
seconds per fingerprint, and their ratio. The fingerprint's cost is a few HTTP round trips per
server with a few thousand values each, whatever the model's size (parameters over MAX_NUMEL
elements are never asked for), plus, for a disk push, reading those rows from the export.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlrecipe.modeling import build_char_tokenizer

    cfg = Qwen2Config(vocab_size=152064, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)
    return out


def run(hidden: int = 256, layers: int = 4, pushes: int = 4) -> dict:
    import torch

    from rlrecipe.modeling import load_model
    from rlrecipe.recipe.systems import SGLangServer
    from rlrecipe.rollout.sglang.engine import SGLangEngine

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model(Path(tmp) / "model", hidden, layers)
        port = _port()
        log = open(Path(tmp) / "serve.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([sys.executable, "-m", "rlrecipe.cli.app", "serve", str(model_dir), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((Path(tmp) / "serve.log").read_text()[-2000:])
                time.sleep(0.5)
            cfg = SGLangServer(weight_sync="distributed", weight_sync_backend="gloo", weight_sync_port=_port())
            eng = SGLangEngine([url], eos_token_id=1, cfg=cfg, served_dtype="float32")
            state = load_model(model_dir).state_dict()
            try:
                for mode in ("disk", "broadcast"):
                    push_s, check_s = [], []
                    for v in range(1, pushes + 1):
                        t0 = time.perf_counter()
                        if mode == "disk":
                            eng.update_weights_from_disk(model_dir, v)
                        else:
                            eng.update_weights_from_state(state, v)
                        push_s.append(time.perf_counter() - t0)
                        check_s.append(eng.weight_check_s)
                    out[f"{mode}_push_s"] = sum(push_s) / pushes
                    out[f"{mode}_fingerprint_s"] = sum(check_s) / pushes
                    out[f"{mode}_fingerprint_share_of_push"] = sum(check_s) / sum(push_s)
            finally:
                eng.close()
            out["params_m"] = sum(t.numel() for t in state.values()) / 1e6
            out["torch_threads"] = torch.get_num_threads()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pushes", type=int, default=4)
    args = ap.parse_args()
    print(json.dumps(run(args.hidden, args.layers, args.pushes), indent=2))


if __name__ == "__main__":
    main()
