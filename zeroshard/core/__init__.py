"""The core of the update: each leaf's geometry (:mod:`~zeroshard.core.layout`), its
placement read from the traced update (:mod:`~zeroshard.core.placement`), where the inner
state lives (:mod:`~zeroshard.core.state_kinds`, :mod:`~zeroshard.core.state_layout`), the
one update flow (:mod:`~zeroshard.core.update`) with its per-owner work
(:mod:`~zeroshard.core.branches`, :mod:`~zeroshard.core.blocks`), sums made whole
(:mod:`~zeroshard.core.sums`), low-bit state (:mod:`~zeroshard.core.lowbit`,
:mod:`~zeroshard.core.piecewise`), rows of one dtype (:mod:`~zeroshard.core.rows`) and the
mesh an update runs on (:mod:`~zeroshard.core.mesh`)."""
