"""A run, built: mesh -> rules -> model -> shardings -> data -> the step, composed here and nowhere else.

>>> from jaxtrain.run_config import apply_overrides, default_config
>>> run = build(apply_overrides(default_config("gpt-tiny"), ["mesh=data=2,tensor=2"]))  # doctest: +SKIP
>>> run.train_step                                   # compiled on first use            # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from jax.sharding import AbstractMesh, Mesh

from jaxtrain.analysis.comm_report import communication_report
from jaxtrain.analysis.memory import memory_report
from jaxtrain.data.chat_template import optional_chat_template, special_tokens
from jaxtrain.data.datasets import (
    Dataset,
    TokenOptions,
    check_dataset,
    global_batch,
    make_dataset,
    model_data_args,
)
from jaxtrain.data.masking import MaskOptions
from jaxtrain.data.pairs import PAIR_KEYS, PAIRS, PreferencePairs
from jaxtrain.data.text_classes import TextOptions
from jaxtrain.data.tokenizer import load_tokenizer
from jaxtrain.data.tokens import token_vocab
from jaxtrain.formatting import fmt_bytes
from jaxtrain.ops.sequence import counted_targets, zigzag_order
from jaxtrain.parallel.grad_sync import GradientSync
from jaxtrain.parallel.pipeline import Pipeline, make_pipeline, stacked_layer_count
from jaxtrain.parallel.step import (
    GradFn,
    accumulate_gradients,
    eval_step,
    replica_gradients,
    train_part,
    train_step,
    value_and_grad_of,
)
from jaxtrain.parallel.updates import UpdatePolicy, local_step, stale_step
from jaxtrain.placement.model import ModelParts
from jaxtrain.placement.place import PlacedModel, place_model
from jaxtrain.placement.precision import with_precision
from jaxtrain.placement.shardings import Shardings
from jaxtrain.posttrain.adapters import adapt
from jaxtrain.posttrain.grpo import ROLLOUT_KEYS, GrpoLoss, grpo_objective
from jaxtrain.posttrain.preference import (
    NEEDS_REFERENCE,
    PreferenceLoss,
    check_model,
    model_batch,
    preference_objective,
)
from jaxtrain.registry import SEQUENCE_TASKS
from jaxtrain.run_config import ConfigError, RunConfig, default_config
from jaxtrain.sharding.mesh import describe_mesh
from jaxtrain.sharding.rules import ShardingRules
from jaxtrain.training.distributed import describe_processes
from jaxtrain.training.optim import make_optimizer

StepFn = Callable[[dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, jax.Array]]]


@dataclasses.dataclass
class Run:
    """Everything a loop needs, built once: the shardings, the step functions (compiled on first use), data, and the
    step's model FLOPs."""

    cfg: RunConfig
    placed: PlacedModel  # the model on the mesh, with its rules: what generation and the examples build on
    shardings: Shardings
    dataset: Dataset
    optimizer: Any
    # ((loss, metrics), grads) of params on a global batch, as the train step computes them; the grads are those of
    # the params that train (`ModelParts.trainable`: an adapted model's adapters)
    grad_fn: GradFn
    step_fn: StepFn  # (state, batch) -> (state, metrics), uncompiled
    tokens_per_step: int  # rows x sequence length (a preference pair is two rows); batch for models without sequences
    pipeline: Pipeline | None = None
    grad_sync: GradientSync | None = None  # an explicit gradient synchronisation algorithm, if one is chosen

    @functools.cached_property
    def flops_per_step(self) -> float:
        """Model FLOPs of one step: the model config's `train_flops(batch_size, seq_len)` where it defines one; else
        XLA's count for the compiled step (its per-device program's, times the devices), which counts the body of a
        loop once, so it undercounts a model that scans its layers (and the MFU shown with it). With frozen weights
        (adapters), the model's FLOPs without its weights' gradients, plus 6 per adapter param and token (forward,
        the input's and the adapter's gradients; an expert's adapter is counted for every token, an upper bound)."""
        train_flops = getattr(self.cfg.model, "train_flops", None)
        if train_flops is not None:
            model = self.shardings.model
            seq_len = self.cfg.data.seq_len if self.placed.spec.task in SEQUENCE_TASKS else 1
            rows = self.tokens_per_step // seq_len  # a batch of preference pairs runs two rows a pair
            if not model.freezes:
                return train_flops(rows, seq_len)
            trained = sum(math.prod(x.shape) for x in jax.tree.leaves(model.trainable(model.abstract_params)))
            # DPO's reference in the step (the adapters switched off) runs a forward pass: a third of the FLOPs (GRPO's
            # runs before the step, once per batch of rollouts).
            reference = train_flops(rows, seq_len) / 3 if self.cfg.preference.loss == "dpo" else 0.0
            return train_flops(rows, seq_len, weight_gradients=False) + 6.0 * trained * self.tokens_per_step + reference
        cost = self.train_step.cost_analysis() or {}
        return float(cost.get("flops", 0.0)) * self.shardings.mesh.size

    def data_metrics(self, step: int) -> dict[str, float]:
        """What the dataset reports of training steps [0, step) (a mixture: tokens drawn per source), if anything."""
        metrics = getattr(self.dataset, "metrics", None)
        return metrics(step, self.cfg.data.batch_size) if metrics else {}

    def batch(self, split: str, step: int) -> dict[str, jax.Array]:
        return global_batch(self.dataset, split, step, self.cfg.data.batch_size, self._batch_shardings)

    @functools.cached_property
    def _batch_shardings(self) -> dict[str, Any]:  # computed once, not at every step of the loop
        return {k: v.sharding for k, v in self._abstract_batch(self.cfg.train.grad_accum).items()}

    def _abstract_batch(self, grad_accum: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
        return self.shardings.abstract_batch(self.dataset.shapes(self.cfg.data.batch_size), grad_accum)

    @functools.cached_property
    def train_step(self) -> jax.stages.Compiled:
        """The compiled optimizer step; the state argument is donated."""
        shardings = self.shardings
        return shardings.compile(
            self.step_fn,
            shardings.abstract_state,
            self._abstract_batch(self.cfg.train.grad_accum),
            out_shardings=(shardings.state_shardings, shardings.replicated),
        )

    @functools.cached_property
    def compiled_grad(self) -> jax.stages.Compiled:
        """`grad_fn` compiled: (params, batch) -> ((loss, metrics), grads), for inspection and tests."""
        shardings = self.shardings
        return shardings.compile(
            self.grad_fn,
            shardings.abstract_state["params"],
            self._abstract_batch(self.cfg.train.grad_accum),
            donate_state=False,
        )

    @functools.cached_property
    def compiled_eval(self) -> jax.stages.Compiled:
        """Loss and metrics on a batch, without updating."""
        shardings = self.shardings
        loss_fn = self.pipeline.loss(shardings.model.loss_fn) if self.pipeline else shardings.model.loss_fn
        return shardings.compile(
            functools.partial(eval_step, loss_fn=loss_fn),
            shardings.abstract_state["params"],
            self._abstract_batch(),
            donate_state=False,
            out_shardings=shardings.replicated,
        )

    @functools.cached_property
    def counted_targets(self) -> Callable[[dict[str, jax.Array]], jax.Array]:
        """How many targets of a batch the loss counts, summed over the batch (float32, replicated): its weight in an
        exact mean over several batches. The sum of a language batch's target weights (`next_tokens`: documents'
        own targets, chat data's assistant tokens); else every example counts once."""

        return jax.jit(counted_targets, out_shardings=self.shardings.replicated)


def setup(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    dataset: Dataset | None = None,
) -> Run:
    """Build mesh, rules, shardings and data, and compile the train step (nothing runs yet).

    `devices`: the devices the mesh spans (default: all of them). `dataset`: your own data (a `Dataset`, e.g.
    `TokenWindows` of token ids in memory) instead of `cfg.data.source`. The preflight it logs is a few lines; with
    `train.verbose`, the full tables.
    """
    run = build(cfg, log, devices, dataset)
    log(memory_report(run.train_step))
    log(communication(run) if cfg.train.verbose else communication_summary(run))
    return run


def communication(run: Run) -> str:
    """The bytes each device sends per step, from the compiled train step, beside the analytic model of an explicit
    gradient synchronisation when one is chosen."""
    expected = run.grad_sync.expected(run.shardings.param_bytes()) if run.grad_sync else ()
    return communication_report(run.train_step, run.shardings.mesh).format(expected)


def communication_summary(run: Run) -> str:
    """One line: the mean bytes a device sends per step, in all and over each set of mesh axes."""
    report = communication_report(run.train_step, run.shardings.mesh)
    by_axes = collections.Counter()
    for row in report.rows:
        by_axes["+".join(row.axes) or "-"] += row.mean
    where = ", ".join(f"{axes} {fmt_bytes(sent)}" for axes, sent in by_axes.items())
    return f"communication per step: {fmt_bytes(report.per_device.mean())} sent per device" + (
        f" ({where})" if where else ""
    )


def with_data_vocab(cfg: RunConfig) -> RunConfig:
    """`cfg` with the model's vocab_size set by its tokenized data (`data.source=tokens`: the tokenizer's size,
    padded to a multiple of 128) where the model has its preset's vocab_size; a vocab_size set to another value is
    kept (the dataset checks that it is enough). Reads the data's manifests, so it is a step of opening the data,
    not of resolving the config (`load_config` reads no file but the one it is given): training (`train`, `build`),
    the planner (`estimate`), the command line and the Ray engine call it, and calling it again changes nothing."""
    d = cfg.data
    vocab = token_vocab(d.source, d.path, d.mixture)
    preset = getattr(default_config(cfg.model_name).model, "vocab_size", None)
    if vocab is None or preset is None or cfg.model.vocab_size != preset or vocab == preset:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def build(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    dataset: Dataset | None = None,
) -> Run:
    """Like `setup`, but compiles nothing: steps compile when first used."""
    cfg = with_data_vocab(cfg)
    placed = place_model(cfg.model_name, cfg.model, cfg.mesh, cfg.rules, devices=devices)
    spec, mesh, rules, model = placed.spec, placed.mesh, placed.rules, placed.model
    if jax.process_count() > 1:
        log(describe_processes(mesh))
    if cfg.data.partition != "uniform" and rules.batch_axes()[:1] != ("replica",):
        raise ConfigError(  # a replica's rows are then no longer one contiguous block of the batch
            f"data.partition={cfg.data.partition} needs 'replica' first in the batch rule; it is {rules.batch_axes()}."
        )
    _check_sequence_split(cfg, mesh, rules, spec.task)
    verbose = cfg.train.verbose
    log(describe_mesh(mesh) if verbose else describe_mesh(mesh).splitlines()[0])  # the first line names the axes

    if mesh.shape["pipeline"] > 1:  # a model the pipeline cannot split is an error before any data is read
        stacked_layer_count(model.logical_names, model.abstract_params)
    dataset = _dataset(cfg, spec.task, mesh, dataset)
    placed = dataclasses.replace(placed, model=with_precision(model, cfg, mesh))
    if placed.model.precision is not None:
        log(placed.model.precision.describe())
    placed = with_adapters(cfg, placed, model_batch(dataset.shapes(cfg.data.batch_size)))
    placed = with_objective(cfg, placed, dataset)
    model = placed.model
    optimizer, schedule = make_optimizer(cfg.optimizer, cfg.train.steps, model.trainable(model.logical_names))
    pipeline = _pipeline(cfg, mesh, model, dataset.shapes(cfg.data.batch_size))
    if pipeline and verbose:
        log(pipeline.describe())
    policy = update_policy(cfg, mesh)
    shardings = with_offload(cfg, placed.shardings(optimizer, pipeline.layout if pipeline else None, policy), policy)
    log(shardings.table() if verbose else f"{shardings.totals()} (--verbose or train.verbose=true: the full tables)")
    # Check the batch divides over the devices before anything compiles.
    shardings.abstract_batch(dataset.shapes(cfg.data.batch_size), cfg.train.grad_accum)

    sync = _gradient_sync(cfg, shardings)
    grad_fn, step_fn = compose_step(cfg, shardings, pipeline, sync, policy, optimizer, schedule)
    seq_len = cfg.data.seq_len if spec.task in SEQUENCE_TASKS else 1
    rows = cfg.data.batch_size * (2 if PAIR_KEYS[0] in dataset.shapes(cfg.data.batch_size) else 1)
    return Run(cfg, placed, shardings, dataset, optimizer, grad_fn, step_fn, rows * seq_len, pipeline, sync)


def compose_step(
    cfg: RunConfig,
    shardings: Shardings,
    pipeline: Pipeline | None,
    sync: GradientSync | None,
    policy: UpdatePolicy,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
) -> tuple[GradFn, StepFn]:
    """The train step, composed here and nowhere else: the gradient, accumulated, synchronised, under an update
    policy, through the update core. Returns the gradient function (params, batch) -> ((loss, metrics), grads) and
    the step (state, batch) -> (state, metrics), both pure and uncompiled (`Shardings.compile` compiles them).
    A model with frozen weights (adapters) gets the gradient of its trainable part, and a step on that part alone."""
    t, mesh, model = cfg.train, shardings.mesh, shardings.model
    trainable, loss_fn = model.trainable if model.freezes else None, model.training_loss_fn
    # 1. The gradient of the model's loss on one piece of the batch, through the pipeline schedule if there is one.
    grad_fn = pipeline.value_and_grad(loss_fn, trainable) if pipeline else value_and_grad_of(loss_fn, trainable)
    # 2. Accumulation: the batch's `grad_accum` pieces one after another, averaged (nothing added for one piece).
    # Pieces and replicas are weighted by their targets (`counted_targets`), so that with any number of each the loss
    # is the mean over the batch's targets, as one device computes it.
    grad_fn = accumulate_gradients(grad_fn, t.grad_accum, counted_targets)
    # 3. Gradient sync. `xla`: nothing added; the shardings make XLA reduce each gradient where it is formed.
    if cfg.allreduce.algorithm == "fused":  # one all-reduce of loss, metrics and the whole gradient, after accumulation
        grad_fn = replica_gradients(grad_fn, mesh, shardings.rules.batch_axes(), count=counted_targets)
    elif sync is not None:  # an explicit algorithm (ring, hierarchical, star) averages the gradient
        grad_fn = replica_gradients(grad_fn, mesh, sync.axes, sync.mean, counted_targets)
    # 4. The update policy chooses the step; 5. every step updates through the update core, `step.apply_update`.
    common = {"grad_fn": grad_fn, "optimizer": optimizer, "schedule": schedule}
    if policy.is_local:  # local_sgd, diloco: each replica steps alone; every `average_every` steps, an outer step
        outer = {"outer": policy.outer_optimizer(), "average_every": policy.average_every, "total_steps": t.steps}
        return grad_fn, functools.partial(local_step, **common, **outer, mesh=mesh)
    if policy.name == "stale":  # the gradient of `staleness` steps ago is applied
        return grad_fn, functools.partial(stale_step, **common, staleness=policy.staleness)
    if model.freezes:  # adapters: the optimizer steps them alone, and the frozen weights pass through
        step = functools.partial(train_step, optimizer=optimizer, schedule=schedule)
        return grad_fn, functools.partial(train_part, step=step, grad_fn=grad_fn, part=model)
    return grad_fn, functools.partial(train_step, **common)


def with_adapters(cfg: RunConfig, placed: PlacedModel, batch: dict[str, jax.ShapeDtypeStruct]) -> PlacedModel:
    """`placed` with the low-rank adapters `cfg.lora` asks for on its model (none at lora.rank=0); `batch`: a batch's
    shapes, to trace the model's loss with (`jaxtrain.posttrain.adapters.adapt`)."""
    if not cfg.lora.rank:
        return placed
    ray_gradients = cfg.engine.kind != "spmd" and not cfg.grpo.group_size  # GRPO on Ray: only the rollouts are
    if cfg.updates.policy != "synchronous" or ray_gradients:
        which = (
            f"updates.policy={cfg.updates.policy}" if cfg.engine.kind == "spmd" else f"engine.kind={cfg.engine.kind}"
        )
        raise ConfigError(
            f"lora.rank={cfg.lora.rank} with {which}: adapters train with the synchronous SPMD step only; use "
            "updates.policy=synchronous and engine.kind=spmd, or lora.rank=0."
        )
    return dataclasses.replace(placed, model=adapt(placed.model, cfg.lora, batch))


def with_objective(cfg: RunConfig, placed: PlacedModel, dataset: Dataset) -> PlacedModel:
    """`placed` with the objective `cfg.preference` asks for in place of its model's own loss, checked against the
    data (pairs for a preference loss, and only for one) and the mesh. A DPO run without adapters reads its reference
    log-probs from the batch: the dataset is told to carry them (`jaxtrain.training.reference` computes them)."""
    if cfg.grpo.group_size:  # GRPO reads rollouts, which its own loop makes (jaxtrain.posttrain.grpo_train)
        return with_grpo(cfg, placed, dataset)
    p, batch = cfg.preference, dataset.shapes(cfg.data.batch_size)
    pairs = PAIR_KEYS[0] in batch
    if p.loss == "none":
        if pairs:
            raise ConfigError(
                f"the data ({type(dataset).__name__}) are preference pairs, which the model's own loss cannot read: "
                "set preference.loss=dpo or preference.loss=simpo."
            )
        return placed
    if not pairs:
        raise ConfigError(
            f"preference.loss={p.loss} trains on pairs of a chosen and a rejected reply, but the data "
            f"({type(dataset).__name__}) give {', '.join(batch)}: pass the pairs as the run's dataset "
            "(jaxtrain.data.pairs.PreferencePairs.from_jsonl), or set preference.loss=none."
        )
    check_model(placed.spec.module, cfg.model_name)
    if placed.mesh.shape["pipeline"] > 1:
        raise ConfigError(
            f"preference.loss={p.loss} with a pipeline axis is not supported yet: use data, fsdp, tensor or context "
            "axes."
        )
    dataset.expects_reference = NEEDS_REFERENCE[p.loss] and not placed.model.freezes  # set either way: a reused one
    objective = preference_objective(PreferenceLoss(p.loss, p.beta, p.gamma))
    return dataclasses.replace(placed, model=dataclasses.replace(placed.model, objective=objective))


def with_grpo(cfg: RunConfig, placed: PlacedModel, dataset: Dataset) -> PlacedModel:
    """`placed` with the GRPO loss `cfg.grpo` asks for in place of its model's own loss, checked against the data (a
    batch of rollouts, `jaxtrain.posttrain.grpo.ROLLOUT_KEYS`), the mesh and the step."""
    g = cfg.grpo
    problem = _grpo_problem(cfg, placed, dataset.shapes(cfg.data.batch_size))
    if problem:
        raise ConfigError(f"grpo.group_size={g.group_size}: {problem}")
    loss = GrpoLoss(g.epsilon_low, g.epsilon_high, g.beta, g.aggregation, g.max_new_tokens)
    return dataclasses.replace(placed, model=dataclasses.replace(placed.model, objective=grpo_objective(loss)))


def _grpo_problem(cfg: RunConfig, placed: PlacedModel, batch: dict[str, jax.ShapeDtypeStruct]) -> str | None:
    """Why GRPO cannot run as configured, in words; None where it can."""
    g = cfg.grpo
    if set(ROLLOUT_KEYS) - set(batch):
        return (
            "GRPO trains on rollouts of the model's own sampler, which its loop makes: run "
            "jaxtrain.posttrain.grpo_train.grpo_train(cfg, prompts, reward), or set grpo.group_size=0."
        )
    if not callable(getattr(placed.spec.module, "target_log_probs", None)):
        return (
            f"model '{cfg.model_name}' gives no per-token log-probs (`target_log_probs`): use a decoder (gpt, llama)."
        )
    if cfg.preference.loss != "none":
        return f"preference.loss={cfg.preference.loss} is another objective: set preference.loss=none."
    if cfg.data.batch_size % g.group_size:
        return (
            f"data.batch_size={cfg.data.batch_size} holds prompts x G completions, and is no multiple of G: use e.g. "
            f"data.batch_size={g.group_size * max(1, cfg.data.batch_size // g.group_size)}."
        )
    if placed.mesh.shape["pipeline"] > 1:
        return "the sampler runs every layer on each device, without a pipeline: use data, fsdp or tensor axes."
    if cfg.train.grad_accum > 1 or cfg.allreduce.algorithm != "xla" or cfg.updates.policy != "synchronous":
        return "GRPO runs the plain step: set train.grad_accum=1, allreduce.algorithm=xla, updates.policy=synchronous."
    return None


def _check_sequence_split(cfg: RunConfig, mesh: Mesh, rules: ShardingRules, task: str) -> None:
    """Where the rules split `seq` over devices (context parallelism), the model must read sequences and the
    sequence must cut into the zig-zag layout's chunks: errors before anything is traced."""
    axes = [a for a in rules.activations.get("seq", ()) if mesh.shape[a] > 1]
    if not axes:
        return
    if task not in SEQUENCE_TASKS:
        raise ConfigError(
            f"mesh '{cfg.mesh}' splits the sequence over {'+'.join(axes)} (context parallelism), but model "
            f"'{cfg.model_name}' reads no sequences: use a mesh without a context axis (e.g. data instead)."
        )
    zigzag_order(cfg.data.seq_len, math.prod(mesh.shape[a] for a in axes))


def update_policy(cfg: RunConfig, mesh: Mesh | AbstractMesh) -> UpdatePolicy:
    """The update policy `cfg.updates` names, checked against the mesh and the gradient sync: training and the
    planner both lay out the state it adds."""
    u, algorithm = cfg.updates, cfg.allreduce.algorithm
    policy = UpdatePolicy(u.policy, u.average_every, u.staleness, u.outer_lr, u.outer_momentum)
    policy.check_mesh(mesh)
    if policy.name != "synchronous" and mesh.shape["pipeline"] > 1:
        raise ConfigError(
            f"updates.policy={u.policy} with a pipeline axis is not supported yet: use updates.policy=synchronous."
        )
    if policy.is_local and algorithm != "xla":
        raise ConfigError(
            f"allreduce.algorithm={algorithm} averages every step's gradient over all replicas, which updates.policy="
            f"{u.policy} exists to avoid: inside each replica XLA reduces the gradient; use allreduce.algorithm=xla."
        )
    return policy


def with_offload(cfg: RunConfig, shardings: Shardings, policy: UpdatePolicy) -> Shardings:
    """`shardings` with the optimizer state in host memory where `optimizer.offload` asks: the state the update core
    (`step.apply_update`) updates, which it brings to the device. Training and the planner both lay it out so."""
    offload = cfg.optimizer.offload
    if offload == "none":
        return shardings
    if policy.is_local:
        raise ConfigError(
            f"optimizer.offload={offload} with updates.policy={policy.name}: each replica's optimizer state is the "
            "policy's own, which its step updates outside the update core; use updates.policy=synchronous or stale, "
            "or optimizer.offload=none."
        )
    if cfg.engine.kind != "spmd" and not cfg.grpo.group_size:  # GRPO on Ray: the learner is the SPMD step
        raise ConfigError(
            f"optimizer.offload={offload} with engine.kind={cfg.engine.kind}: the parameter-server shards keep the "
            "optimizer state in their own processes; use engine.kind=spmd, or optimizer.offload=none."
        )
    return shardings.with_offload(offload)


def _dataset(cfg: RunConfig, task: str, mesh: Mesh, given: Dataset | None) -> Dataset:
    """The caller's dataset, checked against the model and the run's batch, or the one `cfg.data.source` names."""
    data_args = model_data_args(cfg.model)
    if cfg.data.source.split(":", 1)[0] == PAIRS:
        given = preference_pairs(cfg)
    if given is not None:
        return check_dataset(given, task, cfg.data.seq_len, cfg.data.batch_size, data_args["vocab_size"])
    d = cfg.data
    return make_dataset(
        d.source,
        task,
        seed=cfg.train.seed,
        seq_len=d.seq_len,
        **data_args,
        val_fraction=d.val_fraction,
        partition=d.partition,
        replicas=mesh.shape["replica"],
        tokens=TokenOptions(d.path, d.mixture, d.packing, d.prefetch),
        masking=MaskOptions(d.mask_rate, d.whole_words),
        text=TextOptions(d.text_field, d.label_field, d.label_names, d.val_path, d.tokenizer),
    )


def preference_pairs(cfg: RunConfig) -> PreferencePairs:
    """The pairs `data.source=pairs[:FILE]` names, tokenized with `data.tokenizer` (conversations rendered with
    `data.chat_template`, or the tokenizer's own)."""
    d = cfg.data
    path = d.source.split(":", 1)[1] if ":" in d.source else d.path
    if not path or not d.tokenizer:
        missing = " and ".join(k for k, v in (("data.path", path), ("data.tokenizer", d.tokenizer)) if not v)
        raise ConfigError(
            f"data.source={d.source} reads preference pairs from a JSON-lines file with a tokenizer; {missing} "
            "not set: e.g. data.source=pairs:pairs.jsonl data.tokenizer=IMPORT/hf."
        )
    template = optional_chat_template(d.tokenizer, d.chat_template or None)
    eos = special_tokens(d.tokenizer).get("eos_token")
    return PreferencePairs.from_jsonl(
        path, load_tokenizer(d.tokenizer), d.seq_len, cfg.train.seed, d.val_fraction, template, eos
    )


def _pipeline(cfg: RunConfig, mesh: Mesh, model: ModelParts, shapes: dict) -> Pipeline | None:
    """The pipeline schedule and stage layout when the mesh has a pipeline axis; None otherwise."""
    if mesh.shape["pipeline"] == 1:
        return None
    accum, p = cfg.train.grad_accum, cfg.pipeline
    per_step = {k: jax.ShapeDtypeStruct((s.shape[0] // accum, *s.shape[1:]), s.dtype) for k, s in shapes.items()}
    return make_pipeline(
        mesh,
        model.loss_fn,
        model.logical_names,
        model.abstract_params,
        per_step,
        schedule=p.schedule,
        microbatches=p.microbatches,
        virtual=p.virtual_stages,
        balance=p.balance,
        stash=p.stash,
        count=counted_targets,
    )


def _gradient_sync(cfg: RunConfig, shardings: Shardings) -> GradientSync | None:
    """The explicit synchronisation algorithm `allreduce.algorithm` names, over the mesh's data-parallel axes; None
    for XLA's own reduction and for the fused all-reduce. Any but XLA's needs pure data parallelism."""
    a = cfg.allreduce
    if a.algorithm == "xla":
        return None
    _check_pure_data_parallel(cfg, shardings)
    if a.algorithm == "fused":
        return None
    # In mesh order, whatever the order of the batch rule: ppermute over several axes requires it.
    axes = tuple(
        axis
        for axis in shardings.mesh.axis_names
        if axis in shardings.rules.batch_axes() and shardings.mesh.shape[axis] > 1
    )
    bucket = int(a.bucket_mb * 2**20)
    return GradientSync(a.algorithm, axes, dict(shardings.mesh.shape), bucket, a.hubs, a.compression)


def _check_pure_data_parallel(cfg: RunConfig, shardings: Shardings) -> None:
    if shardings.is_pure_data_parallel():
        return
    used = shardings.param_axes()
    other = [
        a for a in shardings.mesh.axis_names if shardings.mesh.shape[a] > 1 and a not in shardings.rules.batch_axes()
    ]
    why = f"parameters are sharded over {', '.join(used)}" if used else f"axes {', '.join(other)} are not data axes"
    raise ConfigError(
        f"allreduce.algorithm={cfg.allreduce.algorithm} averages gradients over data-parallel replicas, each holding "
        f"every parameter; on mesh '{cfg.mesh}' {why}. Use allreduce.algorithm=xla, or a mesh of replica/data "
        "axes only (for fsdp, replicate the weights with rules.params.embed=)."
    )
