"""A training process for the checkpoint tests (device counts differ per process).

python tests/checkpoint_worker.py DEVICES DIR MODE [STEPS] [OUT] [MESHES]
  MODE run:     train STEPS steps from the seed params, saving at step SAVE_AT; write OUT.
  MODE resume:  for each device count M of MESHES (default: DEVICES; e.g. "8,4,2,1"),
                restore the latest step of DIR onto a mesh of the first M devices, train
                up to STEPS; write OUT formatted with M.
  MODE crash:   save step 1, then start saving step 2, print SAVING, and hang there.
"""

import os
import sys
import time

if __name__ == "__main__":
    devices, directory, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    out = sys.argv[5] if len(sys.argv) > 5 else None
    meshes = sys.argv[6] if len(sys.argv) > 6 else str(devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import awkward_loss, awkward_params, batches

    import zeroshard as zs

    SAVE_AT = 3
    rng = np.random.default_rng(0)
    params = awkward_params(rng)
    if mode == "crash":  # large enough that a save takes a while
        params["big"] = jnp.asarray(rng.normal(size=(4096, 2048)), jnp.float32)
    data = batches(rng, max(steps, 2))
    loss_fn = awkward_loss
    if mode == "crash":
        loss_fn = lambda p, b: awkward_loss(p, b) + 1e-6 * jnp.sum(p["big"] ** 2)
    clip = zs.clip_by_global_norm(0.5, axis_name="data")
    tx = zs.sharded(optax.chain(clip, optax.adamw(1e-2, weight_decay=0.1)), axis_name="data")
    ckpt = zs.CheckpointManager(directory, tx, max_to_keep=None)

    def train(mesh, state):
        train_step = zs.make_train_step(loss_fn, tx, mesh)
        while int(state.step) < steps:
            state, _ = train_step(state, data[int(state.step)])
            if mode == "run" and int(state.step) == SAVE_AT:
                ckpt.save(state)  # async, and the next step donates the state at once
        return state

    if mode == "resume":
        for m in map(int, meshes.split(",")):
            mesh = jax.make_mesh((m,), ("data",), devices=jax.devices()[:m])
            state = train(mesh, ckpt.restore(mesh, like=params))
            np.savez(
                out.format(m), *[np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)]
            )
        ckpt.close()
        raise SystemExit(0)
    mesh = jax.make_mesh((devices,), ("data",))
    state = zs.init_train_state(params, tx, mesh)
    if mode == "crash":
        train_step = zs.make_train_step(loss_fn, tx, mesh)
        for i in range(2):
            state, _ = train_step(state, data[i])
            if i == 0:
                ckpt.save(state)
                ckpt.wait_until_finished()
        ckpt.save(state)  # async: returns once the arrays are off the devices
        print("SAVING", flush=True)  # the parent kills this process with SIGKILL now
        time.sleep(120)
        raise SystemExit("the parent should have killed this process")
    state = train(mesh, state)
    ckpt.close()
    np.savez(out, *[np.asarray(x, np.float32) for x in jax.tree.leaves(state.params)])
