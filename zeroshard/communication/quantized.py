"""Quantized: gradients and weights sent as blockwise int8 or int4 codes.

A :class:`Quantizer` turns a list of ``(rows, width)`` parts (leaves' pieces, an owned
row, a stage-3 layer's pieces) into integer codes and float32 scales. Each part is cut
into blocks of at most ``block`` elements, equal within the part (a part of ``w``
elements has ``ceil(w / block)`` blocks; its padding is under one element per block),
so a block never spans two leaves and a small leaf's scale is its own. A block's
``scale`` is ``max |x| / (2^(bits-1) - 1)`` and its codes are ``round(x * (1 /
scale))`` (to the nearest, ties to even), symmetric; int4 codes travel two per byte
(``uint8``), int8 codes as ``int8``. A block holding a ``nan`` or ``inf`` decodes to
non-finite values, so a non-finite step is still seen (and skipped).

The collectives built on it:

- :func:`reduce_scatter`: each device encodes its ``(N, w)`` parts (row ``d`` for
  device ``d``), one ``all_to_all`` delivers every device's codes of my row, and I
  decode and sum them in float32. Each value is quantized once, before it is sent,
  and no partial sum is re-quantized (a ring reduce-scatter would re-quantize at every
  hop); the wire carries ``(N - 1) / N`` of the codes, as a ring's
  reduce-scatter carries ``(N - 1) / N`` of the values.
- :func:`all_gather`: each device encodes its part once; every device (its own
  included) decodes the same codes, so all hold the same values afterwards.
- :func:`all_reduce`: the mean over a second axis (the replica axis) in two levels:
  a quantized reduce-scatter over it, then the mean re-quantized once and
  all-gathered.
- :func:`gathered`: stage 3's gather, whose transpose (the gradients'
  reduce-scatter) can be quantized too.

Example:
    >>> import jax.numpy as jnp
    >>> q = Quantizer(bits=8, block=4)
    >>> codes, scales = q.encode([jnp.array([[1.0, -2.0, 0.5, 4.0, 3.0]])])
    >>> codes.dtype.name, codes.shape, scales.shape  # 2 blocks of 3: 6 codes
    ('int8', (1, 6), (1, 2))
    >>> [x.tolist() for x in q.decode(codes, scales, [5], jnp.float32)]
    [[[1.0078740119934082, -2.0, 0.5039370059967041, 4.0, 2.992125988006592]]]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroshard.communication.collectives import all_gathered_parts, summed_parts

BITS = {"int8": 8, "int4": 4}
"""The quantized formats, by name, and their bits per value."""


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """Blockwise symmetric integer codes (see the module's description).

    Attributes:
      bits: 8 (``int8`` codes) or 4 (``uint8``, two codes per byte).
      block: the most elements per block (one float32 scale each).
    """

    bits: int
    block: int

    @property
    def levels(self) -> int:
        """The largest code: 127 for int8, 7 for int4."""
        return 2 ** (self.bits - 1) - 1

    def blocks(self, width: int) -> tuple[int, int]:
        """``(count, size)`` of the blocks of a part of ``width`` elements."""
        count = max(1, -(-width // self.block))
        return count, -(-width // count)

    def nbytes(self, widths: Sequence[int]) -> int:
        """Bytes per row of the codes and scales of parts of ``widths`` elements."""
        shapes = [self.blocks(w) for w in widths]
        values = sum(c * s for c, s in shapes)
        codes = values if self.bits == 8 else -(-values // 2)
        return codes + 4 * sum(c for c, _ in shapes)

    def classes(self, widths: Sequence[int]) -> dict[int, list[int]]:
        """The parts of ``widths`` elements by block size, in order: parts whose blocks
        have one size are encoded together (the codes lie class by class)."""
        out: dict[int, list[int]] = {}
        for i, width in enumerate(widths):
            out.setdefault(self.blocks(width)[1], []).append(i)
        return out

    def encode(self, parts: Sequence[jax.Array]) -> tuple[jax.Array, jax.Array]:
        """``(codes, scales)`` of ``parts`` (each ``(rows, width)``, any float dtype):
        ``(rows, codes)`` ``int8`` (``uint8`` for int4) and ``(rows, scales)``
        float32, the parts with one block size together (:meth:`classes`)."""
        codes, scales, rows = [], [], parts[0].shape[0]
        for size, members in self.classes([x.shape[1] for x in parts]).items():
            pad = lambda x: ((0, 0), (0, math.prod(self.blocks(x.shape[1])) - x.shape[1]))
            padded = [jnp.pad(parts[i], pad(parts[i])) for i in members]
            v = jnp.concatenate(padded, axis=1).astype(jnp.float32).reshape(rows, -1, size)
            # (times the reciprocal: what XLA makes of a division by a constant anyway)
            scale = jnp.max(jnp.abs(v), axis=2) * np.float32(1 / self.levels)  # nan, inf stay
            q = jnp.round(v * (1 / jnp.where(scale > 0, scale, 1))[..., None])
            codes.append(jnp.clip(q, -self.levels, self.levels).reshape(rows, -1))
            scales.append(scale)
        return self._packed(jnp.concatenate(codes, axis=1)), jnp.concatenate(scales, axis=1)

    def decode(
        self, codes: jax.Array, scales: jax.Array, widths: Sequence[int], dtype: Any
    ) -> list[jax.Array]:
        """The parts of ``widths`` elements (``(rows, width)`` each, in ``dtype``) that
        :meth:`encode` made ``codes`` and ``scales`` of."""
        q, rows = self._unpacked(codes), codes.shape[0]
        parts: list[Any] = [None] * len(widths)
        at, k = 0, 0
        for size, members in self.classes(widths).items():
            count = sum(self.blocks(widths[i])[0] for i in members)
            v = q[:, at : at + count * size].reshape(rows, count, size)
            v = (v * scales[:, k : k + count, None]).reshape(rows, -1)
            start = 0
            for i in members:
                parts[i] = v[:, start : start + widths[i]].astype(dtype)
                start += self.blocks(widths[i])[0] * size
            at, k = at + count * size, k + count
        return parts

    def _packed(self, q: jax.Array) -> jax.Array:
        """Codes as they travel: ``int8``, or int4 offset by 8 and two per ``uint8``."""
        if self.bits == 8:
            return q.astype(jnp.int8)
        q = (q + 8).astype(jnp.uint8)
        q = jnp.pad(q, ((0, 0), (0, q.shape[1] % 2)))
        return q[:, 0::2] | (q[:, 1::2] << 4)

    def _unpacked(self, codes: jax.Array) -> jax.Array:
        """The codes as float32 values, from what :meth:`_packed` sent."""
        if self.bits == 8:
            return codes.astype(jnp.float32)
        pairs = jnp.stack([codes & 15, codes >> 4], axis=2).reshape(codes.shape[0], -1)
        return pairs.astype(jnp.float32) - 8


def quantizer(name: str | None, block: int) -> Quantizer | None:
    """The :class:`Quantizer` of a format name (``None``: none)."""
    return None if name is None else Quantizer(BITS[name], block)


def reduce_scatter(q: Quantizer, parts: Sequence[jax.Array], axis_name: str) -> list[jax.Array]:
    """This device's row of the sum over ``axis_name`` of ``parts`` (each ``(N, w)``,
    row ``d`` for device ``d``): one float32 ``(w,)`` per part. One ``all_to_all``
    each for the codes and the scales."""
    codes, scales = q.encode(parts)
    to_all = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    codes, scales = to_all(codes, tiled=True), to_all(scales, tiled=True)
    return [x.sum(0) for x in q.decode(codes, scales, [p.shape[1] for p in parts], jnp.float32)]


def all_gather(
    q: Quantizer, parts: Sequence[jax.Array], axis_name: str, dtype: Any, **kwargs: Any
) -> list[jax.Array]:
    """Every device's ``parts`` (each 1-D), decoded: one ``(N, w)`` in ``dtype`` per
    part, row ``d`` from device ``d``, the same values on every device. One
    ``jax.lax.all_gather`` (with ``kwargs``) each for the codes and the scales."""
    codes, scales = q.encode([p[None] for p in parts])
    codes = jax.lax.all_gather(codes[0], axis_name, **kwargs)
    scales = jax.lax.all_gather(scales[0], axis_name, **kwargs)
    return q.decode(codes, scales, [p.shape[0] for p in parts], dtype)


def all_reduce(q: Quantizer, parts: Sequence[jax.Array], axis_name: str) -> list[jax.Array]:
    """The mean of each part over ``axis_name`` (float32, the part's shape), the same
    on every device: each part raveled and cut in ``R`` (the axis size), a quantized
    :func:`reduce_scatter` of the cuts, and the mean of mine re-quantized once and
    :func:`all_gather` ed."""
    r = jax.lax.axis_size(axis_name)
    cuts = [jnp.pad(p.reshape(-1), (0, -p.size % r)).reshape(r, -1) for p in parts]
    mine = [x / r for x in reduce_scatter(q, cuts, axis_name)]
    every = all_gather(q, mine, axis_name, jnp.float32, to="invarying")  # as a pmean's
    return [x.reshape(-1)[: p.size].reshape(p.shape) for x, p in zip(every, parts, strict=True)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gathered(
    parts: list[jax.Array], axis_name: str, weights: Quantizer | None, grads: Quantizer | None
) -> list[jax.Array]:
    """Stage 3's gather of 1-D ``parts`` (one ``(N, w)`` per part, row ``d`` from
    device ``d``), quantized by ``weights``; its transpose, the gradients' sum onto
    each part, by ``grads`` (``None``: the exact collective)."""
    if weights is None:
        return all_gathered_parts(parts, axis_name)
    return all_gather(weights, parts, axis_name, parts[0].dtype)


def quantized_gather(
    weights: Quantizer | None, grads: Quantizer | None, parts: list, axis_name: str, dtype: Any
) -> list[jax.Array]:
    """:func:`gathered` of ``parts`` cast to ``dtype``: a step's stage-3 gather
    (:class:`zeroshard.core.update.Route`)."""
    return gathered([p.astype(dtype) for p in parts], axis_name, weights, grads)


def _gathered_forward(parts, axis_name, weights, grads):
    return gathered(parts, axis_name, weights, grads), None


def _gathered_backward(axis_name, weights, grads, _, cotangents):
    if grads is None:
        sums = summed_parts(cotangents, axis_name)
    else:
        sums = reduce_scatter(grads, cotangents, axis_name)
    return ([s.astype(c.dtype) for s, c in zip(sums, cotangents, strict=True)],)


gathered.defvjp(_gathered_forward, _gathered_backward)
