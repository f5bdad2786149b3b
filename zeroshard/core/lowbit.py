"""Low-bit state: the inner optimizer's per-element state stored in 8 or 4 bits.

With ``zs.sharded(inner, state_bits=8)`` (or ``4``) the floating-point state leaves
shaped like a matrix's pieces (Adam's ``mu`` and ``nu``, any optax optimizer's) are
kept between steps as :class:`Codes`: one code per element and one float32 scale
per block of :attr:`LowBit.block` elements. The update decodes them to float32,
runs the inner optimizer, and encodes its new state, in the same jitted step, a
bounded piece of blocks at a time (:mod:`zeroshard.core.piecewise`).

**Blocks follow the leaf's global index.** A coded leaf's pieces are a whole number
of blocks (:attr:`zeroshard.core.layout.Slot.align`), so block ``j`` is elements ``[j B,
(j + 1) B)`` of the raveled leaf (of each layer, for stacked layers) on every device
count and stage, and so are its codes: a block's codes depend on its values only.
Vectors, scalars and matrices with fewer elements per layer than a block keep
their state exact (float32), on every mesh alike.

**The code of an element** is a magnitude on a logarithmic grid, relative to its
block's largest: ``2 ** (-(L - m) / R)`` for ``m`` in ``1..L`` and zero for ``m =
0``. A block with a negative element is coded with a sign bit (Adam's first
moment). A block of non-negative values is coded by the square roots of its
values, on a grid of twice as many magnitudes (the second moment spans many
binades: its square root spans half as many, and the update reads it through a
square root), which the scale's sign records (negative: the square roots were
coded). The grids, per bits and kind:

============  ===========  ============================  ===============================
bits          block        signed (sign + magnitude)     non-negative (its square root)
============  ===========  ============================  ===============================
8             256          L = 127, R = 16: 2**-7.88     L = 255, R = 32: 2**-7.94
4             128          L = 7, R = 1.5: 2**-4         L = 15, R = 3: 2**-4.67
============  ===========  ============================  ===============================

The ranges are what the blocks hold: in Adam's state of the transformers of
``benchmarks/lowbit.py --fidelity``, at most 0.06% of the second moment's square
roots lay below the 8-bit grid at step 10, and at most 0.3% below the 4-bit grid
from step 100 (coded as the smallest point); a first moment's values below its grid
are coded as zero or its smallest point, right on average.

**Rounding is stochastic**: a value between two grid points is coded as the upper
with the probability that makes it right on average, so a moment that moves by less
than a grid step per step (Adam's second moment moves by 0.1%) moves on average,
where rounding to the nearest would hold it still or bias every element alike. A
signed value is right on average (Adam's first moment, read linearly). A square
root is right on average in its own square root (:data:`ROOT_POWER`): the state is
coded again every step, so its rounding errors add up, and Adam reads the second
moment ``v`` through ``1 / sqrt(v)``. Right on average in ``v``, the state keeps
its mean but its spread makes ``1 / sqrt(v)`` too large on average (steps too
long); right on average in ``1 / sqrt(v)``, each read is right but the state
drifts up (steps too short). Right in ``v ** (1/4)``, between the two, they cancel
where measured (``benchmarks/lowbit.py --fidelity``). A positive square root is
never coded as zero (below the grid it is coded as its smallest point: Adam
divides by it). The random number is a hash of the value's bits, its place in its
block and its block's largest value (:func:`uniform`): every device computes the
same codes from the same values, so with ``deterministic=`` the codes are the same
on every device count; without it the float32 state differs between device counts
(as plain optax's does), and an element whose bits differ may round to the other
neighbour. Decoding and encoding again gives the same codes (a checkpoint holds the
decoded state, and restores the codes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class Codes:
    """A coded state leaf: its codes and block scales (both split like its pieces).

    Attributes:
      codes: ``uint8``, one per element (8 bits) or two per byte (4 bits, the
        element at an even index in the low nibble), shaped like the piece with its
        last dimension ``width`` (or ``width / 2``).
      scales: ``float32``, one per block, shaped like the piece with its last
        dimension ``width / block``; negative where the block's square roots were
        coded.
      bits: 8 or 4 (static).
    """

    def __init__(self, codes: Any, scales: Any, bits: int):
        self.codes, self.scales, self.bits = codes, scales, bits

    def tree_flatten(self):
        return (self.codes, self.scales), self.bits

    @classmethod
    def tree_unflatten(cls, bits, children):
        return cls(*children, bits)

    def __repr__(self) -> str:
        return f"Codes(bits={self.bits}, codes={self.codes!r}, scales={self.scales!r})"


def is_codes(x: Any) -> bool:
    return isinstance(x, Codes)


_SNAP = 2.0**-20  # (rounding odds this near 0 or 1 are taken as 0 or 1)

ROOT_POWER = 0.5
"""A coded square root ``s`` is right on average in ``s ** ROOT_POWER``."""


@dataclasses.dataclass(frozen=True)
class Grid:
    """A logarithmic grid of ``L`` magnitudes, ``R`` per binade, and zero."""

    levels: int
    per_binade: float

    def encode(self, ratio: jax.Array, u: jax.Array, power: float = 1.0) -> jax.Array:
        """The magnitude code of each ``ratio`` in ``[0, 1]``, rounded up or down at
        random (``u``, uniform in ``[0, 1)``) so that its decoded value raised to
        ``power`` equals ``ratio ** power`` in expectation."""
        safe = jnp.where(ratio > 0, ratio, 1.0)
        below = jnp.floor(self.levels + self.per_binade * jnp.log2(safe))
        below = jnp.where(ratio > 0, jnp.clip(below, 0, self.levels), 0)
        low, high = self.decode(below) ** power, self.decode(below + 1) ** power
        p = (ratio**power - low) / (high - low)
        # (a value on the grid, as decoding gives, is coded as it was: exactly)
        p = jnp.where(p < _SNAP, 0.0, jnp.where(p > 1 - _SNAP, 1.0, p))
        return (below + (u < p)).astype(jnp.uint8)

    def decode(self, m: jax.Array) -> jax.Array:
        """The magnitude of each code ``m``."""
        m = m.astype(jnp.float32)
        return jnp.where(m > 0, jnp.exp2((m - self.levels) / self.per_binade), 0.0)


@dataclasses.dataclass(frozen=True)
class LowBit:
    """How coded state leaves are stored (:func:`lowbit`; see the module's table).

    Attributes:
      bits: 8 or 4.
    """

    bits: int

    @property
    def block(self) -> int:
        """Elements per block (one float32 scale)."""
        return 256 if self.bits == 8 else 128

    @property
    def signed(self) -> Grid:
        return Grid(127, 16.0) if self.bits == 8 else Grid(7, 1.5)

    @property
    def unsigned(self) -> Grid:
        return Grid(255, 32.0) if self.bits == 8 else Grid(15, 3.0)

    @property
    def sign_bit(self) -> int:
        return self.bits - 1

    def encode(self, x: jax.Array) -> Codes:
        """``x`` (float, last dimension a multiple of :attr:`block`) coded."""
        blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, self.block)
        roots = jnp.all(blocks >= 0, axis=-1, keepdims=True)  # (non-negative: sqrt coded)
        values = jnp.where(roots, jnp.sqrt(jnp.maximum(blocks, 0.0)), blocks)
        top = jnp.max(jnp.abs(values), axis=-1, keepdims=True)
        ratio = jnp.abs(values) / jnp.where(top > 0, top, 1.0)
        u = uniform(blocks, top)
        m = self.signed.encode(ratio, u)  # (a value flushed to zero has no sign)
        sign = jnp.where((blocks < 0) & (m > 0), 1 << self.sign_bit, 0).astype(jnp.uint8)
        # (a positive square root is never coded as zero: Adam divides by it)
        root = self.unsigned.encode(ratio, u, ROOT_POWER)
        root = jnp.maximum(root, (ratio > 0).astype(jnp.uint8))
        code = jnp.where(roots, root, m | sign)
        scales = jnp.where(roots, -top, top)[..., 0]
        return Codes(self._packed(code.reshape(x.shape)), scales, self.bits)

    def decode(self, coded: Codes) -> jax.Array:
        """The float32 values of ``coded``."""
        code = self._unpacked(coded.codes)
        blocks = code.reshape(*code.shape[:-1], -1, self.block)
        scales = coded.scales[..., None]
        magnitude = jnp.uint8((1 << self.sign_bit) - 1)
        signed = self.signed.decode(blocks & magnitude) * scales
        signed = jnp.where((blocks >> self.sign_bit) & 1, -signed, signed)
        roots = self.unsigned.decode(blocks) * -scales
        return jnp.where(scales < 0, roots * roots, signed).reshape(code.shape)

    def _packed(self, code: jax.Array) -> jax.Array:
        if self.bits == 8:
            return code
        pairs = code.reshape(*code.shape[:-1], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)

    def _unpacked(self, codes: jax.Array) -> jax.Array:
        if self.bits == 8:
            return codes
        pairs = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
        return pairs.reshape(*codes.shape[:-1], -1)

    def nbytes(self, elements: int) -> float:
        """Bytes of the codes and scales of ``elements`` (a multiple of the block)."""
        return elements * self.bits / 8 + elements / self.block * 4


def uniform(blocks: jax.Array, top: jax.Array) -> jax.Array:
    """A number in ``[0, 1)`` per element of ``blocks`` (float32, the last axis a
    block) that looks random but is a function of the element's bits, its place in
    its block and the block's largest magnitude ``top`` only: the same on every
    device count, where the values are (each block is the same elements there),
    and new whenever the value changes. A 32-bit integer hash of the three (Chris
    Wellons' ``lowbias32`` mixer), its top 24 bits."""
    bits = jax.lax.bitcast_convert_type(blocks, jnp.uint32)
    lane = jax.lax.broadcasted_iota(jnp.uint32, blocks.shape, blocks.ndim - 1)
    h = bits ^ (lane * jnp.uint32(0x9E3779B9)) ^ jax.lax.bitcast_convert_type(top, jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
    h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * 2.0**-24


def lowbit(bits: int | None) -> LowBit | None:
    """The store of ``state_bits=bits`` (``None``: the state stays as the inner
    optimizer keeps it).

    Raises:
      ValueError: for other bits than 8 and 4.
    """
    if bits is None:
        return None
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"state_bits must be 8, 4 or None, got {bits!r}.")
    return LowBit(bits)
