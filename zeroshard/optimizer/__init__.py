"""The optimizer: ``zs.sharded`` (:mod:`~zeroshard.optimizer.sharded`), its options
(:mod:`~zeroshard.optimizer.config`, validated by :mod:`~zeroshard.optimizer.checks`), its
state (:mod:`~zeroshard.optimizer.state`) and the state's Flax annotations
(:mod:`~zeroshard.optimizer.annotations`); beside it, global-norm clipping
(:mod:`~zeroshard.optimizer.clipping`) and dynamic loss scaling
(:mod:`~zeroshard.optimizer.loss_scale`)."""
