import os
from pathlib import Path

import pytest

import rlrecipe  # noqa: F401 - before any test imports torch: OpenMP takes the package's wait policy
from rlrecipe.core.threads import POLICY_ENV, SHORT_SPIN, SPIN_ENV

# The suite starts its own load (servers, ranks, CLI runs) after each of its processes has chosen how
# its threads wait, which the package's choice at start cannot see: where that choice was the quiet
# one, every process of the suite (this one and those it starts) spins briefly instead. The package's
# own choice is tested by tests/core/test_threads.py; RLRECIPE_TESTS_WAIT=shipped runs the suite under it.
if os.environ.get("RLRECIPE_TESTS_WAIT") != "shipped" and POLICY_ENV not in os.environ and SPIN_ENV not in os.environ:
    os.environ[SPIN_ENV] = SHORT_SPIN

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 + char tokenizer saved as an HF directory (shared by tests, never modified)."""
    from rlrecipe.modeling import create_tiny
    from rlrecipe.recipe.training import TinyModel

    return create_tiny(TinyModel(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                 max_position_embeddings=256), tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="session")
def other_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with perturbed weights, saved as another HF directory."""
    from tests.helpers import perturbed_copy

    return perturbed_copy(tiny_model_dir, tmp_path_factory.mktemp("other") / "model", seed=5)
