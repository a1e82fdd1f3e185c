"""Pipeline parallelism: every schedule computes the 1-device loss and gradients, alone and composed with the
other axes; the compiled programs show the schedule (stage-to-stage permutes, stash memory); bad input is refused."""

import jax
import numpy as np
import pytest
from helpers import BF16_GRAD_RTOL, assert_gradients_close, gradients, make_run

from jaxtrain.analysis.hlo import collectives
from jaxtrain.parallel.pipeline import PipelineError
from jaxtrain.parallel.schedules import ScheduleError, build_schedule
from jaxtrain.run_config import ConfigError

MODEL = ["n_layers=8", "batch_size=16"]
SCHEDULES = {  # name -> extra overrides
    "gpipe": ["schedule=gpipe"],
    "1f1b": ["schedule=1f1b"],
    "interleaved": ["schedule=interleaved", "virtual_stages=2"],
}


@pytest.fixture(scope="module")
def reference():
    return gradients(make_run("single", MODEL, devices=1))


def check_matches(run, reference, loss_rtol=1e-5, grad_rtol=1e-5):
    ref_loss, ref_grads = reference
    loss, grads = gradients(run)
    np.testing.assert_allclose(loss, ref_loss, rtol=loss_rtol)
    assert_gradients_close(grads, ref_grads, rtol=grad_rtol)


def schedule_cases() -> list:
    """(schedule, stages P, microbatches per stage: M = 1, P or 2P), the valid ones only (interleaved needs M to be
    a multiple of P; that it refuses others is tested below). The default suite runs every schedule with M = P on 2
    stages, gpipe and 1f1b with M = 1 too, and the interleaved one (the most intricate table) with M = P on 4; the
    slow set each schedule with the most ticks (4 stages, M = 2P). The other counts are the same programs with
    other tick counts (they passed when they ran here; the slow set dropped them to fit CI's time)."""
    default = [(s, 2, m) for s in SCHEDULES for m in (0, 1) if s != "interleaved" or m] + [("interleaved", 4, 1)]
    slow = [pytest.param(s, 4, 2, marks=pytest.mark.slow) for s in SCHEDULES]
    return default + slow


@pytest.mark.parametrize("schedule,stages,per_stage", schedule_cases())
def test_schedule_matches_single_device(schedule, stages, per_stage, reference):
    microbatches = max(1, per_stage * stages)
    run = make_run(f"pipeline={stages}", [*MODEL, *SCHEDULES[schedule], f"microbatches={microbatches}"], devices=stages)
    check_matches(run, reference)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_composes_with_other_axes(schedule, reference):
    check_matches(make_run("pipeline=2,data=2,tensor=2", [*MODEL, *SCHEDULES[schedule], "microbatches=4"]), reference)


@pytest.mark.slow
def test_four_interleaved_stages_compose_with_fsdp(reference):
    overrides = [*MODEL, *SCHEDULES["interleaved"], "microbatches=4"]
    check_matches(make_run("pipeline=4,fsdp=2", overrides), reference)


def test_stash_of_inputs_recomputes_the_same_gradients(reference):
    overrides = [*MODEL, "microbatches=4", "pipeline.stash=inputs"]
    check_matches(make_run("pipeline=2,data=2,tensor=2", overrides), reference)


# Accumulation wraps whatever the schedule computes: 1f1b by default, the interleaved one with the slow tests.
@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("interleaved", marks=pytest.mark.slow)])
def test_gradient_accumulation_matches_single_device(schedule, reference):
    """2 pieces of 4 microbatches each: the mean of the pieces' gradients is the 1-device gradient of the whole batch
    (a sum would be twice it)."""
    run = make_run("pipeline=2,data=2,tensor=2", [*MODEL, *SCHEDULES[schedule], "microbatches=4", "grad_accum=2"])
    check_matches(run, reference)


def test_bfloat16_compute_with_full_remat():
    """Mixed precision and rematerialisation inside the stages, against the same on one device: bfloat16 rounding,
    so bfloat16 tolerances (measured: the loss within 2e-5, each gradient within 9e-3)."""
    overrides = [*MODEL, "dtype=bfloat16", "remat=full"]
    reference = gradients(make_run("single", overrides, devices=1))
    pipelined = make_run("pipeline=2,data=2,tensor=2", [*overrides, "microbatches=4"])
    check_matches(pipelined, reference, loss_rtol=1e-4, grad_rtol=BF16_GRAD_RTOL)


def test_1f1b_keeps_less_activation_memory_than_gpipe():
    """At M = 4P GPipe stashes every microbatch's activations; 1F1B at most 2P - 1 (see jaxtrain.parallel.schedules)."""
    temp = {}
    for schedule in ("gpipe", "1f1b"):
        overrides = ["n_layers=8", "batch_size=32", f"schedule={schedule}", "microbatches=16"]
        run = make_run("pipeline=4", overrides, devices=4)
        temp[schedule] = run.compiled_grad.memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < 0.7 * temp["gpipe"], temp


def test_stages_pass_activations_and_never_gather_other_stages_weights():
    run = make_run("pipeline=4", [*MODEL, "microbatches=4"], devices=4)
    found = collectives(run.train_step.as_text())
    assert any(c.kind == "collective-permute" for c in found)
    stacked = {tuple(p.shape) for p in jax.tree.leaves(run.shardings.abstract_state["params"]["blocks"])}
    gathers = [s for c in found if c.kind == "all-gather" for _, s in c.shapes]
    assert not [s for s in gathers if s in stacked]  # no stage ever holds all layers' weights


@pytest.mark.slow
def test_uneven_costs_are_balanced_and_still_exact():
    """A head as costly as ~2.5 layers: equal layer counts leave the last stage 1.5x the mean; balancing by
    estimated FLOPs gives it fewer layers (padded storage), and the result is still the 1-device one."""
    model = ["n_layers=12", "vocab_size=2048", "batch_size=16", "microbatches=4"]
    balanced = make_run("pipeline=4", model, devices=4)
    uniform = make_run("pipeline=4", [*model, "pipeline.balance=uniform"], devices=4)
    uniform_costs = uniform.pipeline.layout, balanced.pipeline.costs
    costs = balanced.pipeline.stage_costs()
    assert max(costs) <= 1.25 * np.mean(costs), costs
    even = [balanced.pipeline.costs.stage_cost(j, 3, 4) for j in range(4)]  # what uniform's 3 layers each cost
    assert uniform_costs[0].counts == (3, 3, 3, 3) and max(even) > 1.25 * np.mean(even)
    assert balanced.pipeline.layout.counts[-1] < 3
    check_matches(balanced, gradients(make_run("single", model[:3], devices=1)))


def test_schedule_bubbles_match_theory():
    for name, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for stages in (2, 4):
            for microbatches in (stages, 4 * stages):
                schedule = build_schedule(name, stages, virtual, microbatches)
                assert schedule.bubble() == pytest.approx(schedule.theoretical_bubble())
    assert build_schedule("1f1b", 4, 1, 16).stash_slots == 7  # 2P - 1, independent of M
    assert build_schedule("gpipe", 4, 1, 16).stash_slots == 16


def test_fewer_layers_than_stages():
    with pytest.raises(PipelineError, match="2 layers cannot fill 4 pipeline stages"):
        make_run("pipeline=4,data=2", ["n_layers=2"])


def test_microbatches_incompatible_with_interleaved():
    with pytest.raises(ScheduleError, match="pipeline.microbatches must be a multiple of 2 \\(got 3\\)"):
        make_run("pipeline=2", ["n_layers=4", "batch_size=12", *SCHEDULES["interleaved"], "microbatches=3"], devices=2)


def test_interleaved_chunks_must_divide_layers():
    with pytest.raises(PipelineError, match="6 layers do not split into 4 equal chunks"):
        make_run("pipeline=2", ["n_layers=6", *SCHEDULES["interleaved"], "microbatches=2"], devices=2)


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(PipelineError, match="a batch of 16 rows does not split into 3 pipeline microbatches"):
        make_run("pipeline=2", [*MODEL, "microbatches=3"], devices=2)


def test_unknown_schedule_and_misplaced_virtual_stages():
    with pytest.raises(ConfigError, match="pipeline.schedule='zigzag' is not one of gpipe, 1f1b, interleaved"):
        make_run("pipeline=2", [*MODEL, "schedule=zigzag"], devices=2)
    with pytest.raises(ScheduleError, match="virtual_stages=2 needs schedule=interleaved"):
        make_run("pipeline=2", [*MODEL, "virtual_stages=2"], devices=2)


def test_model_without_layer_stack():
    with pytest.raises(PipelineError, match="has no stacked `layers` dim"):
        make_run("pipeline=2", ["data.source=digits"], model="mlp-tiny", devices=2)


def test_evaluation_matches_single_device():
    """The forward-only schedule used for validation, on a padded layout (3 layers on 2 stages)."""
    model = ["n_layers=3", "microbatches=4"]

    def val_loss(run):
        params = run.shardings.init_state(run.optimizer, 0)["params"]
        return float(run.compiled_eval(params, run.batch("val", 0))["loss"])

    pipelined = make_run("pipeline=2,data=2,tensor=2", model)
    assert pipelined.pipeline.layout.counts == (2, 1)
    np.testing.assert_allclose(val_loss(pipelined), val_loss(make_run("single", model[:1], devices=1)), rtol=1e-5)
