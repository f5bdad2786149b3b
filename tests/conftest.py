"""Simulated devices and the compilation cache: set before JAX starts its backend."""

import os
import pathlib
import platform
import re
import shutil
from importlib.metadata import version

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile a program another test compiled already (the same step on the same
# shapes, the same plain-optax reference): the persistent compilation cache, in the
# checkout (git-ignored), turns those compiles into reads. Every program is still traced
# and lowered; a fresh clone starts with an empty cache. The variables reach the
# processes the tests start (workers, examples, notebook kernels), and the pytest-xdist
# workers share the directory. JAX_ENABLE_COMPILATION_CACHE=false turns it off.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Programs are keyed as jax keys them by default, without their metadata (op names,
# source lines): a test's program read back may carry another test's source lines, and
# zeroshard's named scopes are the same in both. tests/test_scopes.py, which compiles
# steps with and without the scopes, keys its own programs with the metadata.
# Compiling is most of the suite's time: the CPU backend's LLVM code generation at
# optimization level 0 takes ~25% less of it. On jaxlib 0.10 (x86) its older fusion
# code generation (LLVM IR emitters, where jaxlib 0.12 has only its MLIR fusion
# emitters) takes ~35% less again; that one fuses multiplies and adds wherever the
# instruction set has them (a sum's bits then depend on the program around it, and
# deterministic='s runs on 1-8 devices came apart), so it compiles for AVX, which has
# none. The collectives and buffer sizes the tests read are the same (the fusions
# differ: the MLIR emitters wrap single operations as fusions of their own); programs
# run slower, which the suite's small steps do not feel.
# ZEROSHARD_TEST_XLA_OPT=default keeps XLA's own.
if os.environ.get("ZEROSHARD_TEST_XLA_OPT") != "default":
    chosen = {"xla_backend_optimization_level": "0"}
    if version("jaxlib").startswith("0.10.") and platform.machine() in ("x86_64", "AMD64"):
        chosen |= {"xla_cpu_use_fusion_emitters": "false", "xla_cpu_max_isa": "AVX"}
    for flag, value in chosen.items():
        flags = os.environ.get("XLA_FLAGS", "")
        if flag not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --{flag}={value}".strip()
# Eight simulated devices are eight threads on the machine's cores: on a loaded 2-core
# machine one collective's threads can take longer than the CPU backend's 40 s to meet,
# and it then aborts the process (a "Termination timeout" of its rendezvous). Waiting
# longer changes no result; a real deadlock still ends, after 10 minutes.
if "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_collective_call_terminate_timeout_seconds=600"

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)

NUM_DEVICES = 8


def pytest_configure(config):
    """On jax 0.10, empties the checkout's compilation cache before the run's first
    compile (in pytest's first process, before any worker starts). Its CPU runtime can
    deadlock running an executable read back from the cache: the stage-2 Adafactor step
    of tests/test_dropin_stage3.py, read back in a later process, hung in its
    collectives in 4 runs of 6 (threads in an all-reduce inside a loop, others in an
    all-gather); compiled afresh it ran 6 in 6, and on jax 0.12.1 read back 4 in 4. So
    a second run is as cold as the first, and only programs compiled earlier in the
    same run are read back."""
    cache = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"
    ours = os.environ["JAX_COMPILATION_CACHE_DIR"] == str(cache)
    if "PYTEST_XDIST_WORKER" not in os.environ and jax.__version_info__[:2] == (0, 10) and ours:
        shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _check_devices():
    assert jax.device_count() == NUM_DEVICES, "conftest must run before JAX initialises"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# The slow tier (``pytest -m slow``; ``make test-slow``; CI runs it on the newest jax):
# more cases of a property the default tier checks already, on other device counts,
# optimizers or sizes. Each pattern is a regular expression matched from the start of
# the test's id (``file::name[params]``); the comment above each group says why.
SLOW = [
    # optax's whole alias list on 8, 3 and 2 devices; the default tier keeps the
    # configurations with owned leaves or global sums, on 8 devices, but for the second
    # adafactor variant (adafactor3 stays) and lamb (LAMB's per-leaf sums at real sizes
    # are test_real_sizes.py's large-embedding case).
    r"test_owned.py::test_optax_alias_list_matches_plain_optax\[(?!(adafactor3|fromage|lars|"
    r"noisy_sgd|novograd|polyak_sgd|sm3)\d*-8\])",
    r"test_owned.py::test_per_leaf_sums_keep_leaves_sliced\[(\w+-3|(adafactor_unfactored|"
    r"block_rms_clipping|param_block_rms)-8)\]",
    r"test_owned.py::test_zeroshard_clipping_is_summed_once\[3\]",
    # Whole-tensor optimizers on the transformer: Muon's exactness at real sizes stays in
    # test_real_sizes.py (dense and stacked), its collectives in test_owned.py.
    r"test_owned.py::test_whole_tensor_optimizers_on_a_transformer",
    # Owned leaves through stages, accumulation and restores: test_real_sizes.py (layer-owned
    # Muon) and test_stage3.py keep it.
    r"test_owned.py::test_stages_accumulation_and_a_restore_on_another_device_count",
    # Every optimizer on 2 and 4 devices (SGD, which sees a gradient-scale bug, stays).
    r"test_parity.py::test_parity_with_plain_optax\[(?!sgd)\w+-[24]\]",
    # Real sizes: a second optimizer or variant of a case the default tier runs.
    r"test_real_sizes.py::test_muon_on_large_and_stacked_matrices\[.*-False\]",
    r"test_real_sizes.py::test_adafactor_on_stacked_layers\[False\]",
    r"test_real_sizes.py::test_per_tensor_norms_with_a_large_embedding\[(lars|novograd)\]",
    r"test_real_sizes.py::test_stages_and_accumulation\[(adafactor-stacked|lamb-embed)\]",
    r"test_real_sizes.py::test_stacked_layers_restore_on_other_device_counts\[adafactor\]",
    r"test_real_sizes.py::test_stage3_weights_are_pieces_whatever_the_optimizer\[(muon-dense|"
    r"adafactor-stacked|muon_stacked-stacked)\]",  # layer-owned in stage 3: test_stages_...
    r"test_real_sizes.py::test_estimate_memory_is_what_each_stage_holds\[(muon-dense|lamb-embed|"
    r"adafactor-stacked)\]",
    r"test_real_sizes.py::test_stage3_owners_get_the_weights_their_update_reads\[muon\]",
    # Muon's blocked state restored elsewhere: its stacked model's restore stays
    # (test_stacked_layers_restore_on_other_device_counts), the blocked restore with Adafactor.
    r"test_real_sizes.py::test_blocked_state_restores_on_other_device_counts\[muon\]",
    # Adafactor's blocked update spread: Muon's stays, and Adafactor's blocked state is
    # checked in the restore above.
    r"test_real_sizes.py::test_a_dominant_whole_tensor_update_is_spread\[adafactor\]",
    # The largest widths of the planner check (256 stays, for every stage and dtype).
    r"test_memory.py::test_compiled_arguments_match_the_planner\[.*-(512|1024)\]",
    # A second optimizer, variant or stage of a case the default tier runs.
    r"test_meshes.py::test_hierarchical_sharding_matches_plain_optax\[([12]-(adamw|lamb)|3-lamb)\]",
    r"test_nonfinite.py::test_a_bad_gradient_on_one_device_skips_the_step_everywhere\[.*-inf\]",
    r"test_stages.py::test_stage_and_accumulation_match_plain_optax\[adamw-[12]-1\]",
    r"test_logical.py::test_plain_optax_run_continues_under_zeroshard\[.*-1\]",
    r"test_orbax_manager.py::test_restores_exactly_on_8_and_3_and_continues_identically\[\w+-adamw\]",
    r"test_scopes.py::test_scopes_change_no_bit\[1\]",
    # Low-bit state: 8 bits at stage 1 without accumulation and at stage 3 with it (stage
    # 1 with it, stage 3 with 4 bits, stay); the codes on 1-8 devices with 8 bits whole (8
    # bits a piece at a time, and 4 bits, stay); the drop-in's stage 2 and its 8 bits at
    # stage 3 (its 4 bits at stage 3 stay; the own step's are test_lowbit.py's).
    r"test_lowbit.py::test_one_step_is_plain_optax_on_the_decoded_state\[8-(1-1|3-2)-None-False\]",
    r"test_lowbit.py::test_the_codes_are_the_same_on_1_2_4_and_8_devices\[8-None\]",
    r"test_dropin_stage3.py::test_low_bit_state_trains_and_restores_on_4_devices"
    r"\[stage(2-8-adam|3-8-sgd)\]",
    # deterministic= on a tensor-parallel mesh, and over a replica axis, at stage 2
    # (stages 1 and 3 stay).
    r"test_every_axis.py::test_deterministic_on_a_tensor_parallel_mesh\[2\]",
    r"test_deterministic.py::test_a_replica_axis_sums_in_the_same_order\[2\]",
    # The user's step bit for bit against make_train_step (both zeroshard's, so the
    # optimizer only varies the state): every option with SGD at stage 1 and with Adam
    # at stage 2.
    r"test_value_and_grad.py::test_one_step_is_make_train_steps_bit_for_bit"
    r"\[[\w-]+-(adam-1|sgd-2)\]",
    # Alike leaves in one buffer: SGD at stage 1 and AdamW (whose state is grouped too)
    # at stage 3 stay.
    r"test_groups.py::test_alike_leaves_in_one_buffer_give_the_same_bits\[(adamw-1|sgd-3)\]",
    # A third mesh shape of a checkpoint moved from 4 x 2 (two stay).
    r"test_every_axis.py::test_a_checkpoint_saved_on_4x2_restores_on_another_mesh_and_continues"
    r"\[shape2\]",
    # Adam where SGD runs the same case (SGD's numbers see a gradient-scale bug; Adam's
    # update is elementwise, as SGD's, and moves the same bytes): the drop-in's bytes on
    # the wire, a stage-3 loss at stages 1-2 on a tensor-parallel mesh, prefetched stage
    # 3, a padded leaf, the Linen scan, the learning rate set mid-run, tx.value_and_grad's
    # stage-3 exact and accumulated steps, two data axes, stage 2 through gathers; in your
    # own jit at stages 2-3 optax.chain(clip, adamw)'s cases stay.
    r"test_every_axis.py::test_the_dropins_bytes_on_the_wire\[adam-",
    r"test_every_axis.py::test_a_stage_3_loss_at_stages_1_and_2_on_a_tensor_parallel_mesh"
    r"\[\d-\d-adam-",
    r"test_dropin_stage3.py::test_prefetch_gives_plain_optax\[adam-",
    r"test_dropin_stage3.py::test_stages_2_and_3_in_your_own_jit_give_plain_optax\[adam-",
    r"test_dropin_stage3.py::test_a_leaf_the_devices_cannot_cut_is_padded\[mesh\d-inner1\]",
    r"test_dropin_stage3.py::test_linen_scan_through_train_state_at_stage3\[adam-",
    r"test_(dropin|value_and_grad).py::test_the_learning_rate_set_mid_run_with_optax_tree_set"
    r"\[adam-",
    r"test_value_and_grad.py::test_stage3_one_step_is_make_train_steps_bit_for_bit"
    r"\[adam-(exact|accumulated)\]",
    r"test_every_axis.py::test_the_step_over_two_data_axes\[\d-adamw\]",
    r"test_scan.py::test_stage2_through_gathers_matches_plain_optax\[adam-",
    # Programs: a second optimizer or mesh shape of a program the default tier trains.
    r"test_flax_programs.py::test_annotated_minigpt_on_its_mesh",  # test_dropin.py's stays
    r"test_dropin_gemma.py::test_a_gemma_like_model_at_stage3_in_its_own_nnx_jit\[adam\]",
    r"test_dropin_stage3.py::test_minigpt_on_its_tensor_parallel_mesh_at_stage3\[inner1\]",
    r"test_dropin_stage3.py::test_minigpt_through_nnx_optimizer_at_stage3\[adam-",
    r"test_flax_programs.py::test_linen_mnist_example_matches_plain_optax\[lamb_owned\]",
    r"test_flax_programs.py::test_nnx_mnist_tutorial_with_muon",
    r"test_dropin.py::test_the_nnx_mnist_tutorial\[adamw\]",
    r"test_dropin.py::test_the_linen_mnist_example\[adamw\]",
    # Programs that shard by annotations: each program on its second mesh (the Linen
    # one's 4 x 2 fsdp and the NNX one's 4 x 2 tensor stay, with mesh= and without).
    r"test_annotations.py::test_a_linen_program_with_logical_axis_rules\[tensor-",
    r"test_annotations.py::test_an_nnx_program_lays_the_optimizer_out_by_its_metadata\[fsdp-",
    # The Flax steps' options: a replica axis (hierarchical sharding: test_meshes.py; the
    # adapters' path with a manual data axis: stage2-accum2).
    r"test_flax.py::test_flax_steps_match_make_train_step\[replica_axis\]",
    # Flax's drop-in run eagerly, outside any jit (test_dropin.py runs it under jit).
    r"test_flax.py::test_updates_outside_the_steps_take_the_mean_gradient",
    # Two processes: the hierarchical mesh (in one process in test_meshes.py) and a NaN
    # (the agreed skip across processes stays, with an inf in one device's piece).
    r"test_multiprocess.py::test_(hierarchical_across_two_processes|a_nan_on_one_process)",
    # The demo's preemption (zeroshard's own is in test_preemption.py) and the notebooks
    # (make docs executes every one; the default tier checks they carry no outputs).
    r"test_demo.py::test_demo_stops_on_sigterm_and_the_same_command_resumes",
    r"test_notebooks.py::test_notebook_executes",
    # The combinations sampler: the default tier runs the first 8 draws of each test, one
    # draw that once failed per mechanism and the refusals; the slow tier the other draws
    # (192, and 4 through tx.value_and_grad) and the second draws of a mechanism.
    r"test_combinations.py::test_every_combination_(trains_like_optax_or_is_refused|through_value"
    r"_and_grad)\[draw(00[89]|0[1-9]\d|1\d\d)\]",
    r"test_combinations.py::test_combinations_that_failed_inside_jax_train_like_optax"
    r"\[(accum_on_auto_2x2x2|dropin_adafactor_explicit|muon_stage3_explicit_tp)\]",
    # deterministic=: the default tier runs each optimizer, stage and dtype once
    # (test_a_replica_axis_sums_in_the_same_order runs stages 1 and 3 again).
    r"test_deterministic.py::test_bit_identical_on_1_2_4_8_devices\[(?!(adamw\+clip-2-bfloat16|"
    r"lamb-1-float32|adafactor-3-float32|muon-1-bfloat16)\])",
]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marks
def pytest_collection_modifyitems(items):
    slow = re.compile("|".join(f"(?:{p})" for p in SLOW))
    for item in items:
        if slow.match(item.nodeid.removeprefix("tests/")):
            item.add_marker(pytest.mark.slow)
