
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlrecipe.core.errors import UserError
from rlrecipe.modeling import build_char_tokenizer, create_tiny, load_weights_into
from rlrecipe.recipe.training import TinyModel


def test_tiny_model_is_a_normal_hf_directory_and_seeded(tmp_path):
    cfg = TinyModel(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
    a, b, c = (create_tiny(cfg, tmp_path / name, seed) for name, seed in (("a", 1), ("b", 1), ("c", 2)))
    ma, mb, mc = (AutoModelForCausalLM.from_pretrained(d) for d in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values(), strict=True))
    assert not torch.equal(ma.model.embed_tokens.weight, mc.model.embed_tokens.weight)
    tok = AutoTokenizer.from_pretrained(a)
    text = "From 47 add 18 until above 80.\n47+18=65<80 \\boxed{83}"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("\\boxed{") in ids  # one token, not seven
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|user|>hi<|assistant|>"
    assert len(tok) == len(build_char_tokenizer()) == ma.config.vocab_size


def test_weights_load_in_place_from_sharded_export_and_bad_exports_are_named(tmp_path):
    cfg = TinyModel(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
    source = AutoModelForCausalLM.from_pretrained(create_tiny(cfg, tmp_path / "a", 1))
    source.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    target = AutoModelForCausalLM.from_pretrained(create_tiny(cfg, tmp_path / "b", 2))
    load_weights_into(target, tmp_path / "sharded")
    for (name, x), y in zip(source.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied, not overwritten apart
    wider = AutoModelForCausalLM.from_pretrained(create_tiny(cfg.model_copy(update={"intermediate_size": 96}),
                                                             tmp_path / "c", 1))
    with pytest.raises(UserError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp"):
        load_weights_into(wider, tmp_path / "a")


@pytest.mark.parametrize("text", ["12+3=", "é ∑ 中文 🙂", "e\u0301", "\ufb01", "tab\there\r\n", "x\x00y"])
def test_the_tiny_tokenizer_encodes_every_character_as_its_utf8_bytes(text):
    """No character is lost or replaced: the text is NFC-normalised, then each UTF-8 byte is one
    token, and decoding gives the normalised text back (docs/robustness.md)."""
    import unicodedata

    from rlrecipe.modeling import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    normalised = unicodedata.normalize("NFC", text)
    assert len(ids) == len(normalised.encode("utf-8"))
    assert tok.decode(ids) == normalised
