"""One process of the multi-process agreed-skip test (tests/test_multiprocess.py).

python tests/nonfinite_worker.py --local-devices 4 --num-processes 2 --process-id I \
    --coordinator HOST:PORT

Every process trains the same stage-1 and stage-3 steps (helpers.one_piece_*): a clean
step, then two whose mean gradient's only non-finite element lies in one device's
piece, on the other process from the device whose row holds the inf. Each process
checks its own devices: every one counts each skip, and no weight or optimizer state
changes. It prints one line per stage when its devices pass, and fails otherwise.
"""

import argparse
import os
import sys

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-devices", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--timeout", type=int, default=30, help="seconds to wait for peers")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
            heartbeat_timeout_seconds=args.timeout,
            shutdown_timeout_seconds=args.timeout,
        )
    import numpy as np
    import optax

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import (
        BAD_ELEMENTS,
        assert_skipped_everywhere,
        check_one_piece_batch,
        one_piece_batch,
        one_piece_loss,
        one_piece_params,
        shards,
    )

    import zeroshard as zs

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    batch_sharding = jax.NamedSharding(mesh, jax.P("data"))

    def global_batch(full: dict) -> dict:
        """This process's rows of ``full`` as global arrays."""
        rows = batch_sharding.addressable_devices_indices_map((16,)).values()
        start, stop = min(r[0].start for r in rows), max(r[0].stop for r in rows)
        return {
            k: jax.make_array_from_process_local_data(batch_sharding, v[start:stop], v.shape)
            for k, v in full.items()
        }

    positions = sorted(list(mesh.devices.flat).index(d) for d in jax.local_devices())
    for stage in (1, 3):
        rng = np.random.default_rng(0)  # the same params and batches on every process
        params = one_piece_params(rng)
        tx = zs.sharded(optax.adamw(1e-2), axis_name="data")
        state = zs.init_train_state(params, tx, mesh, stage=stage)
        gathered = lambda p, b: one_piece_loss(zs.gather(p), b)
        step = zs.make_train_step(gathered if stage == 3 else one_piece_loss, tx, mesh, stage=stage)
        state, _ = step(state, global_batch(one_piece_batch(rng)))
        for skips, (row, column) in enumerate(BAD_ELEMENTS, start=1):
            batch = one_piece_batch(rng, row, column)
            check_one_piece_batch(params, batch, column)
            before = shards(state)
            state, _ = step(state, global_batch(batch))
            assert_skipped_everywhere(before, shards(state), skips)
        print(f"stage {stage}: devices {positions} skipped 2 steps, changed nothing", flush=True)
