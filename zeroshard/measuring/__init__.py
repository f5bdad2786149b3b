"""Measuring: the planner of bytes per device (:mod:`~zeroshard.measuring.memory`), the
bytes and collectives of a compiled step (:mod:`~zeroshard.measuring.instruments`), and the
names zeroshard's work carries in a profile (:mod:`~zeroshard.measuring.scopes`)."""
