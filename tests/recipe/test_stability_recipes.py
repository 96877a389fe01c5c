"""The remedy recipes: each is tiny_rl with one remedy on, and nothing else changed."""

import pytest

from tests.helpers import recipe_changes

CLAIMS = {
    # the recipe spells out GSPO's clip range, which is the default
    "tiny_rl_gspo.yaml": {"rl.ratio_level": "sequence", "rl.loss_agg": "seq_mean_token_mean"},
    "tiny_rl_clip_cov.yaml": {"rl.cov.mode": "clip_cov"},
    "tiny_rl_kl_cov.yaml": {"rl.cov.mode": "kl_cov"},
    "tiny_rl_kl_ref.yaml": {"rl.kl_coef": 0.05, "rl.kl_estimator": "k3_unbiased"},
    "tiny_rl_entropy.yaml": {"rl.entropy_coef": 1e-3, "rl.entropy_watch.low": 0.02, "rl.entropy_watch.high": 2.0},
    "tiny_rl_positive_only.yaml": {"rl.negative_adv_scale": 0.0},
    "tiny_rl_fp16.yaml": {"trainer.fp16_autocast": True, "rollout.dtype": "float16"},
    "tiny_rl_dynamic_sampling.yaml": {"rl.dynamic_sampling.enabled": True},
    "tiny_rl_overlong.yaml": {"rl.overlong.filter": True, "rl.overlong.cache": 32, "rl.overlong.penalty": 5.0},
    # QAE and Dr. GRPO baselines are per group, where tiny_rl normalises over the batch; K = 0.4 is
    # the default, spelled out
    "tiny_rl_qae.yaml": {"rl.adv_norm": "group_quantile"},
    "tiny_rl_dr_grpo.yaml": {"rl.adv_norm": "group_mean"},
}


@pytest.mark.parametrize("name", CLAIMS)
def test_remedy_recipe_changes_only_what_it_claims(name):
    changed = recipe_changes("tiny_rl.yaml", name)
    assert changed.pop("run.name") == name.removesuffix(".yaml").replace("_", "-")
    assert changed == CLAIMS[name]
