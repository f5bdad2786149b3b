"""Communication: the collectives (:mod:`~zeroshard.communication.collectives`), how a
gradient arrives (:mod:`~zeroshard.communication.arrival`: from local gradients, partial
sums, pieces or the mean, given a codec of :mod:`~zeroshard.communication.codecs`: exact,
:mod:`~zeroshard.communication.quantized` or in the fixed order of
:mod:`~zeroshard.communication.canonical`), how the new weights leave
(:mod:`~zeroshard.communication.departure`), and stage 3's gathers
(:mod:`~zeroshard.communication.stage3`; in the user's own ``jax.jit``:
:mod:`~zeroshard.communication.jit_gather`, :mod:`~zeroshard.communication.jit_pieces`)."""
