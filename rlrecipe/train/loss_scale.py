"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision
Training", Sec. 3.2), with DeepSpeed's rules so both engines behave alike.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The loss is multiplied by
`scale` before backward and the gradients divided by it after; a step whose gradients overflow
(inf/NaN) is skipped. Overflow: the first `hysteresis - 1` overflows only use up the hysteresis,
then each one halves the scale (never below `min_scale`). An overflow-free step that follows a
positive multiple of `window` overflow-free steps in a row doubles the scale and refills the
hysteresis. These are DeepSpeed's DynamicLossScaler rules (consecutive_hysteresis off), step for
step; the defaults are AReaL's DeepSpeed fp16 settings: initial scale 2^32, window 5, hysteresis
2, minimum 1.
"""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**32, window: int = 5, hysteresis: int = 2, min_scale: float = 1.0,
                 factor: float = 2.0):
        self.scale = float(init_scale)
        self.window, self.hysteresis, self.min_scale, self.factor = window, hysteresis, float(min_scale), factor
        self.hysteresis_left = hysteresis
        self.good_steps = 0

    def can_lower(self) -> bool:
        """Whether an overflow now would still lower the scale or use up hysteresis (else the
        gradients are non-finite whatever the scale)."""
        return self.scale > self.min_scale or self.hysteresis_left > 1

    def update(self, overflow: bool) -> None:
        """After each optimizer step (taken or skipped)."""
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        if self.good_steps > 0 and self.good_steps % self.window == 0:
            self.scale *= self.factor
            self.hysteresis_left = self.hysteresis
        self.good_steps += 1  # overflow-free steps in a row before the next one

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.good_steps = int(state["good_steps"])
