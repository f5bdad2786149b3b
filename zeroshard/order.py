"""Order: the order of a step's sums, one object chosen once by the options.

:class:`Psum` (the default) leaves every sum to the collectives and the compiler: a
partial sum in the update is ``psum``-ed over the axis where it is used, and the
bits of a sum follow the device count. :class:`FixedOrder` (``deterministic=M``)
runs every sum in an order fixed by ``M`` alone (:mod:`zeroshard.canonical`): the
leaves are cut into ``M`` canonical chunks, each partial sum in the update is made
the leaf's total in that order where it is taken, and a division by a scalar is a
product with its reciprocal. :attr:`zeroshard.ShardConfig.sum_order` picks one; the
plan, the sums inside the update (:mod:`zeroshard.sums`), the step's checks and its
micro-batches (:mod:`zeroshard.microbatches`, chosen with the route) ask it, and no
module tests the option.

Example:
    >>> Psum().chunks, FixedOrder(8).chunks, FixedOrder(8).any_order
    (0, 8, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from zeroshard import canonical
from zeroshard.layout import Slot


@dataclasses.dataclass(frozen=True)
class Psum:
    """Sums as the collectives give them (the default).

    Attributes:
      chunks: the canonical chunks a leaf's layers are cut into (none: ``0``).
      any_order: whether sums may run in any order, so alike leaves may be updated
        as one buffer and a whole-tensor update may run on blocks.
      rewrites: whether the inner update is evaluated equation by equation even
        where no sum needs making whole.
    """

    chunks = 0
    any_order = True
    rewrites = False

    def over(self, slots: Sequence[Slot]) -> Psum:
        """This order for a plan's leaves (``slots``)."""
        return self

    def check_drop_in(self) -> None:
        """Refuses an order the user's own step cannot keep (none here)."""

    def made_whole(self, sums: Any, xs: list, axis: str) -> list:
        """Operands whose partial sums (``sums.summed``) are summed over ``axis``."""
        return [jax.lax.psum(x, axis) if k in sums.summed else x for k, x in enumerate(xs)]

    def noted(self, eqn: Any, xs: list, scalars: dict) -> None:
        """Records what :meth:`divided` needs of ``eqn`` (nothing here)."""

    def total(self, eqn: Any, sums: Any, xs: list, axis: str) -> list | None:
        """``eqn``'s outputs where it is a sum this order takes itself, else ``None``."""
        return None

    def divided(self, eqn: Any, sums: Any, xs: list, scalars: dict) -> list | None:
        """``eqn``'s outputs where it is a division this order rewrites, else ``None``."""
        return None


PSUM = Psum()


@dataclasses.dataclass(frozen=True)
class FixedOrder(Psum):
    """Every sum in an order fixed by ``parts`` (``deterministic=parts``): the same
    bits on every device count that leaves each device at least two of the ``parts``
    micro-batches.

    Attributes:
      parts: the micro-batches of the global batch, and the canonical chunks of
        every layer (a power of two).
      slots: the plan's leaves, whose canonical chunks the sums run over (see
        :meth:`over`).
    """

    parts: int
    slots: tuple[Slot, ...] = ()
    any_order = False
    rewrites = True

    @property
    def chunks(self) -> int:
        return self.parts

    def over(self, slots: Sequence[Slot]) -> FixedOrder:
        return dataclasses.replace(self, slots=tuple(slots))

    def check_drop_in(self) -> None:
        raise ValueError(
            f"zs.sharded(..., deterministic={self.parts}) fixes the order of the gradients' "
            "sums, which happen in the step: use it with zs.make_train_step (or zs.flax's "
            "steps). In your own step the gradients arrive summed already, in an order that "
            "depends on the device count."
        )

    def made_whole(self, sums: Any, xs: list, axis: str) -> list:
        """The operands as they are: each partial sum is taken as the leaf's total in
        the fixed order (:meth:`total`)."""
        if sums.whole:
            raise ValueError(
                "zs.sharded(..., deterministic=...): the inner update sums over several "
                "parameters (a global norm, say) including one updated whole on its owner, "
                "whose sum has no fixed order across device counts yet. Clip before the "
                "optimizer that needs whole tensors, or leave deterministic= unset."
            )
        return xs

    def noted(self, eqn: Any, xs: list, scalars: dict) -> None:
        """A scalar broadcast: the scalar, by the broadcast's variable."""
        if eqn.primitive.name == "broadcast_in_dim" and _rank(eqn.invars[0]) == 0:
            scalars[eqn.outvars[0]] = xs[0]

    def total(self, eqn: Any, sums: Any, xs: list, axis: str) -> list | None:
        """A partial sum made the leaf's total in the fixed order, or an explicit
        ``psum`` of such totals left out (they are totals already)."""
        if sums is None or not (sums.partial is not None or sums.psum):
            return None
        if sums.psum:
            return xs
        part = canonical.leaf_part(xs[0], self.slots[sums.partial])
        out = eqn.outvars[0].aval
        return [canonical.totals([part], axis)[0].astype(out.dtype).reshape(out.shape)]

    def divided(self, eqn: Any, sums: Any, xs: list, scalars: dict) -> list | None:
        """A division by a scalar made a product with its reciprocal (see
        :func:`scalar_divisor`)."""
        divisor = scalar_divisor(eqn, sums, xs, scalars)
        return None if divisor is None else [xs[0] * (1 / divisor).astype(xs[0].dtype)]


def scalar_divisor(eqn: Any, sums: Any, xs: list, scalars: dict) -> Any:
    """The scalar (rank 0) a value is divided by in ``eqn``, if it is such a ``div``.

    XLA compiles ``x / s`` either as a division or as a product with ``1 / s``,
    depending on what the program around it fuses, so the same update can round
    apart in two programs (on one device and on several, say). Written as the
    product, it rounds the same in every program."""
    if eqn.primitive.name != "div" or not jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating):
        return None  # (an integer division is not a product)
    v = eqn.invars[1]
    if sums is not None and sums.size is not None:
        return xs[1]  # a mean's divisor, made the leaf's size
    if isinstance(v, jex_core.Var) and v in scalars:
        return scalars[v]
    return jnp.asarray(xs[1]) if _rank(v) == 0 else None


def _rank(v: Any) -> int:
    """The rank of a traced variable or literal (a scalar's: 0, even where the
    value is a one-element piece of a parameter, whose rank is its leaf's)."""
    return len(v.aval.shape)
