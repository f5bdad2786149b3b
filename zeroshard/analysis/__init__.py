"""Analysis: which leaves the inner optimizer may update as slices, and which need whole tensors.

Running an optimizer on a slice of a leaf gives the same numbers as running it on the
full leaf if each output element depends on the same element of the gradients and
weights, plus scalars such as the step count and *sums* over elements: a per-tensor
norm (LAMB's and LARS's trust ratios), an RMS or a mean (Adafactor's update clipping),
a global norm over several leaves (``optax.clip_by_global_norm``). A sum over this
device's piece is partial; summed over the devices (padding left out, a mean divided
by the whole leaf's size) it is the sum over the leaf, and the slice's update is
exact (:mod:`zeroshard.core.sums` evaluates the update so). A factored second moment
(Adafactor's row and column means), a matrix function (Muon's Newton-Schulz) or a
shape-dependent rule mixes the elements of one leaf in other ways: such a leaf is
*owned*, placed whole on one device, or layer by layer for stacked layers the update
treats separately. Mixing several leaves other than by sums cannot be made exact by
placement and is refused. All of this is read from the traced computation (the
jaxpr), not from a list of names:

- :mod:`~zeroshard.analysis.tags`: what each traced value derives from (its tag), and
  where partial sums must be summed over the axis;
- :mod:`~zeroshard.analysis.layers`: which stacked leaves' updates keep their layers
  apart;
- :mod:`~zeroshard.analysis.jaxprs`: reading jaxprs alike on every jax version, and the
  one walker (:func:`~zeroshard.analysis.jaxprs.walk`, calls inlined) that the tags, the
  layer axes and :mod:`zeroshard.core.sums` follow a jaxpr with;
- :mod:`~zeroshard.analysis.reads`: whether a loss reads its parameters only through
  :func:`zeroshard.gather` (for stage 2's held step, :mod:`zeroshard.training.held`);
- :mod:`~zeroshard.analysis.leaves` (:func:`analyze`): what each leaf needs, from the
  update traced on full leaves, on slices and on one layer. A leaf whose update
  depends on its shape (factored only when large, masked by shape) is owned too.
"""

from zeroshard.analysis.groups import input_names, leaf_forms
from zeroshard.analysis.leaves import Analysis, analyze, check_extra_args, trace_update
from zeroshard.analysis.tags import NotElementwiseError

__all__ = [
    "Analysis",
    "NotElementwiseError",
    "analyze",
    "check_extra_args",
    "input_names",
    "leaf_forms",
    "trace_update",
]
