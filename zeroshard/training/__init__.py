"""The training step: zeroshard's own step (:mod:`~zeroshard.training.step`), its
micro-batches (:mod:`~zeroshard.training.microbatches`), what it reads and returns besides
the state (:mod:`~zeroshard.training.step_io`), the whole-mesh step
(:mod:`~zeroshard.training.whole_mesh`), stage 2 for a loss that gathers
(:mod:`~zeroshard.training.held`); around the loop, preemption
(:mod:`~zeroshard.training.preemption`) and lost peers (:mod:`~zeroshard.training.peers`)."""
