"""Dynamic loss scaling for fp16 compute, agreed across devices.

fp16 gradients underflow to zero below about 6e-8. Multiplying the loss by a scale S
multiplies every gradient by S (exactly, for a power of two), lifting them into
range; the update divides by S again. When a step's scaled gradients overflow, the
non-finite check of :func:`zeroshard.sharded` skips the step on every device and the
scale halves; after ``growth_interval`` finite steps in a row it doubles. Every
device sees the same verdict (it rides on the gradient-norm all-reduce), so the
scale never diverges across devices.

Example:
    >>> import jax.numpy as jnp
    >>> config = DynamicLossScale(initial=2.0**15, growth_interval=2)
    >>> state = config.init()
    >>> state = config.adjust(state, jnp.bool_(False))  # overflow: halve
    >>> float(state.scale)
    16384.0
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
    """The current scale (float32) and the count of finite steps since it last changed
    (int32); both replicated."""

    scale: jax.Array
    good_steps: jax.Array


class DynamicLossScale(NamedTuple):
    """How the loss scale moves.

    Attributes:
      initial: the scale to start from (a power of two keeps scaling exact).
      growth_interval: finite steps in a row after which the scale doubles.
      factor: what the scale is multiplied by on growth and divided by on overflow.
      minimum: the scale never goes below this.
    """

    initial: float = 2.0**15
    growth_interval: int = 2000
    factor: float = 2.0
    minimum: float = 1.0

    def init(self) -> LossScaleState:
        """The state at the first step."""
        return LossScaleState(jnp.float32(self.initial), jnp.int32(0))

    def adjust(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The state after a step whose gradients were ``finite`` (or not)."""
        good = state.good_steps + 1
        grow = finite & (good >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, state.scale * self.factor, state.scale),
            jnp.maximum(state.scale / self.factor, self.minimum),
        )
        good = jnp.where(finite & ~grow, good, 0)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))
