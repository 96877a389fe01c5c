"""Pure tensor functions of the algorithms: packing, advantages, PPO loss, IcePop/TIS weights."""
