"""Multi-process zeroshard training: one process per host, started the same way on each.

Every process runs this script with its own ``--process-id``; ``jax.distributed``
joins them into one global set of devices, the mesh spans all of them, and every
zeroshard call (init, step, checkpoint save/restore) is made by every process, in
the same order. Each process feeds only its own rows of each global batch.

Two processes with 4 simulated CPU devices each, on one machine:

    python examples/multihost.py --num-processes 2 --process-id 0 &
    python examples/multihost.py --num-processes 2 --process-id 1

On a cluster, pass the first host's address as ``--coordinator`` and the real
``--local-devices`` count (or drop it on GPU/TPU). ``--mesh replica-data`` shards the
optimizer state within each process and replicates it across processes
(hierarchical sharding), so only 1/N of the gradient crosses between them.

With ``--ckpt DIR`` the run is preemption-safe and resumes by itself: it starts from
the latest step in DIR if there is one, and on SIGTERM (to any process) every process
finishes the step in flight, they agree on one step to stop at
(:class:`zeroshard.PreemptionGuard`), save it, wait for the save and exit 0. Run the
same command again to continue, bit-identically on the same device count. If a
process dies, the others end within ``--step-timeout`` seconds with exit code 75 and a
message saying how to resume (:class:`zeroshard.PeerWatchdog`), instead of an abort
after jax's heartbeat timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", default="127.0.0.1:12355", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=None, help="simulated CPU devices")
    parser.add_argument("--mesh", choices=["data", "replica-data"], default="data")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt", default=None, help="checkpoint directory")
    parser.add_argument("--save-at", type=int, default=None, help="save after this step")
    parser.add_argument(
        "--restore", action="store_true", help="require a step in --ckpt to resume from"
    )
    parser.add_argument("--out", default=None, help="process 0 writes losses and state here")
    parser.add_argument(
        "--nan-at", type=int, default=None, help="put a NaN in the last process's rows of this step"
    )
    parser.add_argument("--timeout", type=int, default=60, help="seconds to wait for peers")
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="seconds a step may take before a peer counts as lost (default: --timeout / 2)",
    )
    parser.add_argument(
        "--step-seconds", type=float, default=0.0, help="pause after each step (a slow step)"
    )
    parser.add_argument(
        "--deterministic",
        type=int,
        default=None,
        help="zs.sharded(..., deterministic=M): the same bits on any device count dividing M",
    )
    parser.add_argument(
        "--devices", type=int, default=None, help="use the first N devices only (one process)"
    )
    args = parser.parse_args(argv)
    if args.restore and not args.ckpt:
        parser.error("--restore needs --ckpt")
    if args.step_timeout is None:  # below the heartbeat timeout: this message comes first
        args.step_timeout = args.timeout / 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cpu = args.local_devices is not None
    if cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    # Backend options must be set before JAX touches a device.
    if cpu:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
            # A dead or failed peer ends every process instead of hanging them.
            heartbeat_timeout_seconds=args.timeout,
            shutdown_timeout_seconds=args.timeout,
        )
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeroshard as zs

    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    if args.mesh == "data":
        devices = jax.devices()[: args.devices]
        mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
        tx = zs.sharded(inner, axis_name="data", deterministic=args.deterministic)
    else:  # each process's devices form one "data" group
        mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("replica", "data"))
        tx = zs.sharded(inner, axis_name="data", replica_axis="replica")
    rng = np.random.default_rng(0)  # the same initial params on every process
    params = {
        "hidden": {"w": rng.normal(size=(16, 64)) / 4, "b": np.zeros(64)},
        "out": {"w": rng.normal(size=(64, 4)) / 8, "b": np.zeros(4)},
    }
    params = jax.tree.map(lambda x: x.astype(np.float32), params)

    def loss_fn(p, batch):
        h = jax.numpy.tanh(batch["x"] @ p["hidden"]["w"] + p["hidden"]["b"])
        return jax.numpy.mean((h @ p["out"]["w"] + p["out"]["b"] - batch["y"]) ** 2)

    batch_sharding = NamedSharding(mesh, P(tx.config.batch_axes))

    def global_batch(step: int, size: int = 32) -> dict:
        """This process's rows of global batch ``step`` as global arrays. (Here every
        process can compute the whole batch; a real loader reads only its rows.)"""
        data = np.random.default_rng(1000 + step)
        full = {
            "x": data.normal(size=(size, 16)).astype(np.float32),
            "y": data.normal(size=(size, 4)).astype(np.float32),
        }
        if step + 1 == args.nan_at:  # a row that only the last device reads
            full["x"][-1, 0] = np.nan
        rows = batch_sharding.addressable_devices_indices_map((size,)).values()
        start, stop = min(r[0].start for r in rows), max(r[0].stop for r in rows)
        return {
            k: jax.make_array_from_process_local_data(batch_sharding, v[start:stop], v.shape)
            for k, v in full.items()
        }

    ckpt = zs.CheckpointManager(args.ckpt, tx) if args.ckpt else None
    resume = ckpt is not None and ckpt.latest_step() is not None
    if args.restore and not resume:
        raise SystemExit(f"--restore: no step to resume from in {args.ckpt}")
    state = ckpt.restore(mesh, params) if resume else zs.init_train_state(params, tx, mesh)
    step = zs.make_train_step(loss_fn, tx, mesh)
    guard = zs.PreemptionGuard()  # before the first step: SIGTERM from now on is handled
    # A lost peer ends this process within --step-timeout s, with a message (exit 75).
    watchdog = zs.PeerWatchdog(args.step_timeout, checkpoint_dir=args.ckpt)
    losses = []
    t0 = time.perf_counter()
    for i in range(int(state.step), args.steps):
        with watchdog.watch(f"step {i + 1}"):
            state, metrics = step(state, global_batch(i))
            losses.append(float(metrics["loss"]))  # replicated: readable on every process
            if jax.process_index() == 0:
                skipped = int(state.opt_state.skipped)
                print(f"step {i + 1}: loss {losses[-1]:.6f}, skipped {skipped}", flush=True)
            if ckpt is not None and args.save_at == i + 1:
                ckpt.save(state)
            stop = guard.should_stop(i + 1)  # the same step on every process
        if stop:
            if ckpt is None:
                raise SystemExit(f"preempted after step {i + 1}; nothing saved (no --ckpt)")
            with watchdog.watch(f"saving step {i + 1}"):
                if args.save_at != i + 1:
                    ckpt.save(state)
                ckpt.close()  # waits until the step is committed on disk
            print(
                f"process {jax.process_index()}: preempted, saved step {i + 1} in "
                f"{args.ckpt}; run the same command again to resume",
                flush=True,
            )
            return
        time.sleep(args.step_seconds)
    with watchdog.watch("the final save and gather"):
        if ckpt is not None:
            ckpt.close()  # every process waits for the save to be committed
        # Sharded arrays span other processes' devices: gather them to read them.
        logical = multihost_utils.process_allgather(zs.to_optax_state(state, tx), tiled=True)
    if jax.process_index() == 0:
        print(
            f"{jax.process_count()} processes, {jax.device_count()} devices, mesh "
            f"{dict(mesh.shape)}: {len(losses)} steps in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        if args.out:
            flat = jax.tree_util.tree_leaves_with_path(logical)
            arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}
            skipped = np.asarray(int(state.opt_state.skipped))
            np.savez(args.out, losses=np.asarray(losses), skipped=skipped, **arrays)


if __name__ == "__main__":
    sys.exit(main())
