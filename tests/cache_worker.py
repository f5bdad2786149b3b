"""One process of the compilation-cache test (tests/test_step.py).

python tests/cache_worker.py CACHE_DIR

Turns on jax's persistent compilation cache in CACHE_DIR (every program cached, however
fast it compiled), builds zeroshard's state and stage-1 step for the awkward test tree
on 8 simulated devices, runs two steps and prints one JSON line: the cache's hits and
misses counted by jax's own monitoring events, and the trained weights' bytes (hex).
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import numpy as np
    import optax
    from helpers import awkward_loss, awkward_params, batches, make_mesh

    import zeroshard as zs

    events = {"hits": 0, "misses": 0}

    def count(event: str, **_) -> None:
        name = event.removeprefix("/jax/compilation_cache/cache_")
        if event.startswith("/jax/compilation_cache/") and name in events:
            events[name] += 1

    jax.monitoring.register_event_listener(count)
    rng = np.random.default_rng(0)
    params, mesh = awkward_params(rng), make_mesh(8)
    tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
    state = zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(awkward_loss, tx, mesh)
    for batch in batches(rng, 2):
        state, _ = step(state, batch)
    weights = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(state.params))
    print(json.dumps({**events, "weights": weights.hex()}))
