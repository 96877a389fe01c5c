"""What the benchmarks count, checked by hand."""

import torch

from bench.run import generated_tokens


def test_generated_tokens_stop_at_the_first_eos():
    eos, pad = 1, 0
    new = torch.tensor([[5, 6, eos, pad, pad],   # 3: two tokens and the eos
                        [7, eos, 8, eos, pad],   # 2: only the first eos ends it
                        [5, 5, 5, 5, 5],         # 5: no eos, cut at max_new_tokens
                        [eos, pad, pad, pad, pad]])  # 1
    assert generated_tokens(new, eos) == 3 + 2 + 5 + 1
