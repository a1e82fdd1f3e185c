"""Run configuration: frozen dataclasses, named presets, TOML run config files and `key=value` overrides.

>>> cfg = apply_overrides(default_config("gpt-tiny"), ["n_layers=3", "optimizer.learning_rate=0.01"])
>>> cfg.model.n_layers, cfg.optimizer.learning_rate
(3, 0.01)

A run config file is TOML in the shape of the config (`describe_config` prints every key; every run with a checkpoint
directory writes its own there as `config.toml`, which `load_config` reads back to the same run):

    model_name = "gpt-tiny"        # the model and preset: they set every default
    mesh = "data=2,tensor=2"
    [model]
    n_layers = 3
    [optimizer]
    learning_rate = 0.01
    [train]
    steps = 100
    [rules]                        # logical name -> mesh axes; a [rules.params] or [rules.activations] table sets one
    embed = "fsdp"

The sections are the parts the components take: `model`, `optimizer`, `data`, `train` (the loop itself),
`allreduce` (how gradients are averaged), `updates` (the update policy), `pipeline`, `checkpoint`, `tracking`
(metrics and profiles), `engine` and `lora` (low-rank adapters). A key of an earlier version (`RENAMED`: most sat
in `[train]`) is translated, with a notice on stderr.

A top-level key may also name a field as an override does (`steps = 100`). Precedence, lowest first: the preset's
defaults (`model_name`, or `--model`, which wins over the file's), the file, the command line's flags, its
`key=value` overrides; within each a later value of a key wins, and a section's changes from all of them are checked
together. Every value is checked against its field's declaration (type, choices, bounds) as it is read, with the
key, the value, what was expected and the file's path; an unknown key names the closest ones.

Why TOML and not YAML: `tomllib` is in the standard library and its values are typed as written, whereas YAML 1.1
(PyYAML) reads `learning_rate: 1e-3` as a string and `progress: no` as false, which a config must not guess at.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import tomli_w

from jaxtrain.data.datasets import PARTITIONS
from jaxtrain.data.masking import MASK_RATE
from jaxtrain.data.packing import PACKINGS
from jaxtrain.errors import ConfigError, UserInputError
from jaxtrain.files import read_bytes, utf8_text
from jaxtrain.parallel.grad_sync import ALGORITHMS, COMPRESSIONS
from jaxtrain.parallel.schedules import SCHEDULES
from jaxtrain.parallel.updates import POLICIES
from jaxtrain.registry import resolve_model
from jaxtrain.settings import Settings, accepts_of, describe_field, problem, scalar_types, setting

OPTIMIZERS = ("adamw", "sgd", "adafactor", "lion", "muon")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Settings):
    """The optimizer (`name`), with linear warmup, cosine decay to `min_lr_ratio * learning_rate`, global-norm
    clipping (`clip_norm` <= 0: none) and decoupled weight decay, for every `name` alike. Fields named after one
    optimizer (`adafactor_*`, `muon_*`) set only that one's options; setting them for another is an error."""

    section: ClassVar[str] = "optimizer"

    name: str = setting(
        "adamw",
        "sgd: plain SGD; adafactor: factored second moments (Shazeer & Stern); lion: sign of momentum (Chen et al.); "
        "muon: orthogonalised momentum for weight matrices, AdamW for the rest (Jordan et al.)",
        choices=OPTIMIZERS,
    )
    learning_rate: float = setting(3e-3, "the peak, after warmup", at_least=0)
    warmup_steps: int = setting(20, "steps of linear warmup from 0", at_least=0)
    min_lr_ratio: float = setting(0.1, "the cosine decay ends at this fraction of learning_rate", at_least=0, at_most=1)
    weight_decay: float = setting(0.1, "decoupled weight decay, times the scheduled learning rate", at_least=0)
    beta1: float = setting(0.9, "first-moment decay of AdamW, Lion and Muon's AdamW", at_least=0, below=1)
    beta2: float = setting(
        0.95,
        "second-moment decay of AdamW and Muon's AdamW; Lion's update momentum (its paper: 0.99)",
        at_least=0,
        below=1,
    )
    clip_norm: float = setting(1.0, "global-norm gradient clipping; <= 0: none")
    offload: str = setting(
        "none",
        "state: keep the optimizer state in host memory (pinned_host) between steps; the update moves it to the "
        "device and back, trading a host transfer each way per step for its device memory (docs/memory.md)",
        choices=("none", "state"),
    )
    adafactor_factored: bool = setting(True, "factor the second moment of matrices into row and column statistics")
    adafactor_min_dim_size_to_factor: int = setting(
        128, "factor only where the two largest dims are at least this long", at_least=1
    )
    adafactor_decay_rate: float = setting(0.8, "the second moment decays as 1 - step^-decay_rate", above=0, at_most=1)
    adafactor_clipping_threshold: float = setting(1.0, "clip each update's RMS to this; <= 0: none")
    adafactor_parameter_scale: bool = setting(True, "scale the learning rate by each parameter's RMS (relative steps)")
    adafactor_momentum: float = setting(
        0.0, "first-moment decay; 0: none (the memory-saving default)", at_least=0, below=1
    )
    muon_momentum: float = setting(0.95, "Muon's momentum decay", at_least=0, below=1)
    muon_nesterov: bool = setting(True, "Nesterov momentum (Muon's and its AdamW's)")
    muon_ns_steps: int = setting(5, "Newton-Schulz iterations that orthogonalise each update", at_least=1)
    muon_adam_learning_rate: float = setting(
        0.0, "peak learning rate of the AdamW for the non-matrix params (same schedule); 0: learning_rate", at_least=0
    )
    muon_consistent_rms: float = setting(
        0.0,
        "0: scale updates by sqrt(max(1, fan_out / fan_in)) (Jordan); > 0: by sqrt(max(fan_in, fan_out)) times this, "
        "0.2 matching AdamW's update RMS (Liu et al.), so AdamW's learning rate and weight decay carry over",
        at_least=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        foreign = [
            f"{self.key(f.name)}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name.split("_")[0] in OPTIMIZERS
            and not f.name.startswith(f"{self.name}_")
            and getattr(self, f.name) != f.default
        ]
        if foreign:
            raise ConfigError(
                f"{', '.join(foreign)} set{'s' if len(foreign) == 1 else ''} another optimizer's option, but "
                f"optimizer.name={self.name}: set optimizer.name to the optimizer the option belongs to, or drop it."
            )


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    """`source`: builtin (text shipped with Python; for text classification a generated sentiment task) | synthetic
    (random data of the model's shapes) | digits (CSV) | clicks (synthetic click logs, for recommenders) | tokens
    (shards of `jaxtrain tokenize`: `path`, or a `mixture`; `tokens:DIR` for short) | pairs (preference pairs: the
    JSON lines at `path`, tokenized with `tokenizer`; `pairs:FILE` for short) | a text file path (for text
    classification, a JSON-lines file of texts and labels). A masked language model masks any token source's rows
    (`mask_rate`, `whole_words`: jaxtrain.data.masking)."""

    section: ClassVar[str] = "data"

    source: str = setting(
        "builtin",
        "builtin, synthetic, digits, clicks, tokens[:DIR], pairs[:FILE], or a text, digits-CSV or JSON-lines path",
    )
    path: str = setting("", "data.source=tokens: the directory jaxtrain tokenize wrote; pairs: the JSON-lines file")
    # Tokenized data (jaxtrain.data.packing): concat joins documents by their end-of-text token; segments packs
    # whole documents into rows with segment ids, so attention and the loss stay inside each document.
    packing: str = setting("concat", "data.source=tokens: how documents fill rows", choices=PACKINGS)
    mixture: str = setting("", "data.source=tokens: DIR_A:0.7,DIR_B:0.3, deterministic by weight; empty: data.path")
    prefetch: int = setting(2, "data.source=tokens: training steps read ahead on a background thread", at_least=0)
    tokenizer: str = setting(
        "", "pairs, text classification: the tokenizer (tokenizer.json, or a model directory holding it)"
    )
    chat_template: str = setting(
        "", "data.source=pairs: conversations' chat template (a built-in name or a file); empty: the tokenizer's"
    )
    batch_size: int = setting(32, "global, across all devices and processes", at_least=1)
    seq_len: int = setting(128, "tokens per example", at_least=1)
    val_fraction: float = setting(0.1, "the part of a text source held out for validation", above=0, below=1)
    # How labelled training data is split over the `replica` mesh axis: uniform (shuffled) | stratified (each
    # replica gets the global class mix) | by_label (each replica a few classes: non-IID, the federated setting).
    # Synchronous training does not care; local SGD / FedAvg does. Text and synthetic data take only uniform.
    partition: str = setting("uniform", "how labelled data is split over replicas", choices=PARTITIONS)
    # Masked-language-model data (jaxtrain.data.masking): of the positions chosen, 80% become the mask token, 10% a
    # random token, 10% stay; whole words: a word's tokens are chosen together.
    mask_rate: float = setting(MASK_RATE, "MLM: the share of positions chosen for prediction", above=0, below=1)
    whole_words: bool = setting(False, "MLM: choose whole words, not single tokens")
    # Text classification (jaxtrain.data.text_classes): one JSON object a line, a text and a label.
    text_field: str = setting("text", "text classification: the JSON field holding the text")
    label_field: str = setting("label", "text classification: the JSON field holding the label")
    label_names: str = setting("", "text classification: names of labels in class order (neg,pos); empty: integers")
    val_path: str = setting("", "text classification: a JSON-lines file to validate on; empty: hold out val_fraction")


WANDB_MODES = ("auto", "online", "offline")  # auto: online where W&B credentials are found (jaxtrain.training.tracking)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Settings):
    """What the training loop itself takes: its length, batches per step, seed, logging, validation, rollback and
    how it reports."""

    section: ClassVar[str] = "train"

    steps: int = setting(200, "optimizer steps of the whole run", at_least=1)
    grad_accum: int = setting(1, "sequential pieces of the global batch per optimizer step", at_least=1)
    # Updates with a non-finite loss or gradient are skipped and counted; this many in a row restore the newest
    # checkpoint and skip the batches since (0: never roll back).
    rollback_after: int = setting(10, "non-finite steps in a row before a rollback; 0: never", at_least=0)
    log_every: int = setting(10, "steps between logged metrics", at_least=1)
    eval_every: int = setting(100, "steps between validations", at_least=1)
    eval_batches: int = setting(4, "batches per validation", at_least=1)
    # Generation on held-out chat prompts (jaxtrain.posttrain.sft_eval): the val split's conversations up to their
    # last assistant turn, continued greedily and scored against that turn; logged as val_<scorer>.
    generate_eval_every: int = setting(0, "steps between generation scores on held-out prompts; 0: none", at_least=0)
    generate_eval_prompts: int = setting(32, "held-out conversations each generation score reads", at_least=1)
    generate_eval_max_new_tokens: int = setting(32, "new tokens a generation score lets a reply have", at_least=1)
    generate_eval_scorer: str = setting("exact_match", "a registered scorer's name, or module:function")
    generate_eval_stop: str = setting("", "the token that ends a reply; empty: the chat template's eos_token")
    # lm-eval-harness tasks on the training mesh (jaxtrain.evaluation.in_loop; the eval extra), logged as
    # val_<task>_<metric>; local tasks are YAML files in eval_tasks_include_path.
    eval_tasks: str = setting("", "lm-eval task names, comma-separated; empty: none")
    eval_tasks_every: int = setting(0, "steps between task evaluations; 0: with each validation", at_least=0)
    eval_tasks_limit: int = setting(0, "documents per task at each evaluation; 0: all", at_least=0)
    eval_tasks_include_path: str = setting("", "a folder of lm-eval task YAML files, beside lm-eval's own tasks")
    seed: int = setting(0, "seeds the params and the data order", at_least=0)
    progress: bool = setting(True, "a progress bar, not log lines")
    verbose: bool = setting(False, "the preflight's full tables (parameters, device grid, collectives)")


@dataclasses.dataclass(frozen=True)
class AllReduceConfig(Settings):
    """How gradients are averaged over the data-parallel axes (jaxtrain/parallel/grad_sync.py)."""

    section: ClassVar[str] = "allreduce"

    # xla: the compiler places the reductions (per layer, inside the backward loop, where they can overlap compute).
    # fused: one all-reduce of the whole gradient per step. ring | hierarchical | star: explicit algorithms, in
    # buckets of bucket_mb, with messages in `compression` (none | bf16); star: every device sends each shard of its
    # gradient to one of `hubs` devices, which sum and send the sum back. All but xla need every parameter
    # replicated over the data-parallel axes.
    algorithm: str = setting("xla", "how gradients are averaged", choices=("xla", "fused", *ALGORITHMS))
    bucket_mb: float = setting(4.0, "explicit algorithms: MiB per bucket", above=0)
    hubs: int = setting(1, "algorithm=star: devices that sum the shards", at_least=1)
    compression: str = setting("none", "explicit algorithms: message dtype", choices=tuple(COMPRESSIONS))


@dataclasses.dataclass(frozen=True)
class UpdatesConfig(Settings):
    """The update policy: when gradients meet the params (jaxtrain/parallel/updates.py)."""

    section: ClassVar[str] = "updates"

    # synchronous | local_sgd | diloco | stale. local_sgd and diloco train each index of the `replica` mesh axis
    # apart for average_every steps, then average (diloco: an outer Nesterov step of outer_lr, outer_momentum);
    # stale applies each gradient `staleness` steps late.
    policy: str = setting("synchronous", "when gradients meet the params", choices=POLICIES)
    average_every: int = setting(4, "local_sgd, diloco: local steps between averages", at_least=1)
    staleness: int = setting(1, "policy=stale: steps a gradient arrives late", at_least=0)
    outer_lr: float = setting(0.7, "diloco: the outer Nesterov step", above=0)
    outer_momentum: float = setting(0.9, "diloco: the outer momentum", at_least=0, below=1)


@dataclasses.dataclass(frozen=True)
class PipelineConfig(Settings):
    """Pipeline parallelism, used when the mesh has a pipeline axis (jaxtrain/parallel/pipeline.py)."""

    section: ClassVar[str] = "pipeline"

    # The schedule (gpipe | 1f1b | interleaved), microbatches per step (0: one per stage), chunks per device for
    # interleaved, and how layers are assigned to stages (cost: balance estimated FLOPs, counting the embedding and
    # head; uniform: equal layer counts), and what each forward keeps for its backward (residuals: autodiff's;
    # inputs: the stage input, recomputing).
    schedule: str = setting("1f1b", "pipeline schedule", choices=SCHEDULES)
    microbatches: int = setting(0, "pipeline microbatches per step; 0: one per stage", at_least=0)
    virtual_stages: int = setting(1, "interleaved schedule: layer chunks per device", at_least=1)
    balance: str = setting("cost", "how layers are assigned to pipeline stages", choices=("cost", "uniform"))
    stash: str = setting("residuals", "what a pipeline forward keeps for its backward", choices=("residuals", "inputs"))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Settings):
    """Checkpoints (jaxtrain.training.checkpoint): a directory turns them on; the same command resumes from its
    newest one."""

    section: ClassVar[str] = "checkpoint"

    dir: str = setting("", "save checkpoints here and resume from the newest; empty: no checkpoints")
    every: int = setting(100, "steps between checkpoints; 0: only at the end", at_least=0)
    keep: int = setting(3, "how many of the newest checkpoints are kept", at_least=1)
    keep_every: int = setting(0, "also keep every M-th step's checkpoint; 0: none", at_least=0)
    restore: str = setting("", "start from this checkpoint step directory when checkpoint.dir has none")
    # A training step's params alone, with a new optimizer at step 0 (fine-tuning it on other data, SFT); a params
    # export (an import from Hugging Face) always starts so, and so do new adapters on a checkpoint trained without.
    restore_params_only: bool = setting(False, "restore checkpoint.restore's params only: a new optimizer at step 0")
    # Comma-separated config keys that may differ from the checkpoint's when resuming in checkpoint.dir (e.g.
    # "optimizer.learning_rate,train.steps"); the change is recorded in the run's history. Empty: none may.
    allow_change: str = setting("", "config keys that may differ from the checkpoint's, comma-separated")
    # A save that fails (disk full, permission denied): stop the run (exit 74, the previous checkpoint intact), or
    # continue, log it, and try again at the next save. The final save must succeed either way.
    on_failure: str = setting("stop", "what a failed save does", choices=("stop", "continue"))


@dataclasses.dataclass(frozen=True)
class TrackingConfig(Settings):
    """What the run records besides checkpoints: metrics (JSONL, TensorBoard, W&B) and profiles."""

    section: ClassVar[str] = "tracking"

    metrics_file: str = setting("", "append one JSON object per logged step to this file")
    tensorboard_dir: str = setting("", "also write the logged metrics as TensorBoard scalars here (tensorboardX)")
    wandb_project: str = setting("", "also log the metrics to this Weights & Biases project; empty: no W&B")
    wandb_mode: str = setting(
        "auto", "W&B: online, offline, or auto (online where credentials are)", choices=WANDB_MODES
    )
    wandb_dir: str = setting("", "W&B's local files; empty: the checkpoint directory, else the working directory")
    profile_steps: str = setting("", "trace steps START:STOP-1 with jax.profiler (e.g. 10:13); empty: none")
    profile_dir: str = setting("", "where the profile_steps trace goes (and a device memory profile on OOM)")


@dataclasses.dataclass(frozen=True)
class LoraConfig(Settings):
    """Low-rank adapters (LoRA, Hu et al. 2021) on the weight matmuls: `rank` > 0 trains only the adapters of the
    `targets` (jaxtrain/posttrain/adapters.py), every base weight frozen; 0 (the default) trains the whole model."""

    section: ClassVar[str] = "lora"

    rank: int = setting(0, "each adapter's inner dim; 0: no adapters, every weight trains", at_least=0)
    alpha: float = setting(16.0, "adapters' outputs are scaled by alpha / rank", above=0)
    dropout: float = setting(0.0, "dropout on each adapter's input while training", at_least=0, below=1)
    targets: str = setting(
        "attention,mlp",
        "comma-separated: attention (weights with embed and heads/kv_heads dims), mlp (embed and mlp dims), weight "
        "names (w_q) or paths (blocks/w_q) as the parameter table shows them",
    )
    quantize: str = setting(
        "none",
        "how the frozen base weights are stored (QLoRA): none (as the model has them), int8, int4 or nf4 (codes and "
        "a scale per output channel, dequantized in the matmul)",
        choices=("none", "int8", "int4", "nf4"),  # none, and the kinds of jaxtrain.posttrain.quantized.QTYPES
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.refuse_when_off("rank", self.rank == 0, "trains no adapters", "set lora.rank (e.g. 8) to train adapters")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig(Settings):
    """Low-precision weight matmuls (jaxtrain/placement/precision.py): `matmuls` int8 or fp8 quantizes both operands
    of each chosen weight's matmul (qwix's quantized training), forward and, by default, backward; `gather` moves
    FSDP's weight all-gather in 8 bits, with any matmul precision."""

    section: ClassVar[str] = "precision"

    matmuls: str = setting(
        "none",
        "the chosen weights' matmuls: none (the compute dtype), int8, or fp8 (e4m3 forward, e5m2 gradients)",
        choices=("none", "int8", "fp8"),
    )
    targets: str = setting(
        "attention,mlp",
        "comma-separated: attention, mlp, weight names (w_q) or paths (blocks/w_q) as the parameter table shows them; "
        "the output head, embeddings and norms stay in high precision unless named",
    )
    scales: str = setting(
        "channel",
        "one scale per output channel (and per token for activations), or one per tensor",
        choices=("channel", "tensor"),
    )
    backward: str = setting(
        "quantized",
        "the gradient matmuls: quantized (int8 for int8; e5m2 gradients for fp8) or high (the compute dtype)",
        choices=("quantized", "high"),
    )
    gather: str = setting(
        "none",
        "how FSDP gathers the chosen weights: none (in the compute dtype) or 8bit (int8 codes and their scales, "
        "dequantized after the gather; with matmuls=fp8, e4m3 codes)",
        choices=("none", "8bit"),
    )

    @property
    def active(self) -> bool:
        return self.matmuls != "none" or self.gather != "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.active:
            self.refuse_when_off(
                "matmuls", True, "changes no matmul", "set precision.matmuls=int8|fp8 or precision.gather=8bit"
            )


@dataclasses.dataclass(frozen=True)
class PreferenceConfig(Settings):
    """Preference optimisation on pairs of replies (`jaxtrain.posttrain.preference`, data: `jaxtrain.data.pairs`):
    `loss` dpo (against a reference: the starting model, or with adapters the base) or simpo (reference-free); none
    (the default) trains the model's own loss."""

    section: ClassVar[str] = "preference"

    loss: str = setting("none", "none (the model's own loss), dpo or simpo", choices=("none", "dpo", "simpo"))
    beta: float = setting(0.1, "how far the policy may move from the reference (the rewards' scale)", above=0)
    gamma: float = setting(0.5, "simpo: the target reward margin", at_least=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.refuse_when_off(
            "loss", self.loss == "none", "trains the model's own loss", "set preference.loss=dpo or simpo"
        )
        if self.loss == "dpo" and self.gamma != 0.5:
            raise ConfigError(
                f"preference.gamma={self.gamma} is simpo's margin, and preference.loss=dpo has none: set "
                "preference.loss=simpo, or drop preference.gamma."
            )


@dataclasses.dataclass(frozen=True)
class GrpoConfig(Settings):
    """GRPO on rollouts of the trainer's own sampler (`jaxtrain.posttrain.grpo_train`): `group_size` G > 1 completions
    of each prompt, data.batch_size = prompts per step x G; 0 (the default) trains the model's own loss. The loss's
    keys are `jaxtrain.posttrain.grpo.GrpoLoss`'s, the sampling keys the generator's."""

    section: ClassVar[str] = "grpo"

    group_size: int = setting(0, "G completions sampled per prompt; 0: no GRPO", at_least=0)
    prompts: str = setting("", "jaxtrain train: the prompts' JSON-lines file (the Python API takes them as given)")
    rewards: str = setting(
        "", "jaxtrain train: comma-separated rewards (exact_match, format:REGEX without commas, module:function)"
    )
    num_iterations: int = setting(
        1,
        "optimizer steps on each batch of rollouts (TRL's num_iterations); train.steps counts optimizer steps",
        at_least=1,
    )
    epsilon_low: float = setting(0.2, "the ratio's lower clip is 1 - epsilon_low", above=0, below=1)
    epsilon_high: float = setting(0.2, "the ratio's upper clip is 1 + epsilon_high (DAPO: 0.28)", above=0)
    beta: float = setting(0.0, "weight of the KL to the reference (k3); 0 computes no reference", at_least=0)
    aggregation: str = setting(
        "dapo",
        "token losses to one number: grpo (per completion), dapo (per token), dr_grpo (constant divisor)",
        choices=("grpo", "dapo", "dr_grpo"),
    )
    scale: str = setting(
        "std",
        "advantages divided by the group's std, the batch's, or none (Dr. GRPO)",
        choices=("std", "batch", "none"),
    )
    max_new_tokens: int = setting(32, "the most tokens a completion may have", at_least=1)
    temperature: float = setting(1.0, "sampling temperature (the loss weighs the model's own log-probs)", above=0)
    top_p: float = setting(1.0, "sample among the likeliest tokens whose probability reaches p", above=0, at_most=1)
    eos_id: int = setting(-1, "the token that ends a completion (kept as its last); -1: none", at_least=-1)
    eval_prompts: str = setting(
        "",
        "held-out prompts (JSON lines), completed greedily and scored by the rewards at the start, every "
        "train.eval_every steps and at the end; empty: none",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size == 1:
            raise ConfigError(
                "grpo.group_size=1: each reward would be its own group's mean, every advantage 0, and nothing "
                "learned; use grpo.group_size >= 2 (TRL's default is 8), or 0 for no GRPO."
            )
        self.refuse_when_off("group_size", self.group_size == 0, "trains no GRPO", "set grpo.group_size (e.g. 8)")


ENGINES = ("spmd", "ray")
ENGINE_MODES = ("async", "sync")
STALENESS_LR = ("none", "inverse")


@dataclasses.dataclass(frozen=True)
class EngineConfig(Settings):
    """How the run executes. `spmd`: one SPMD program over the mesh, every device in lockstep (`jaxtrain train`'s
    loop). `ray`: a parameter-server job on Ray (`jaxtrain.asynchronous`): `workers` JAX processes, each on its own
    mesh (`mesh`, over `devices_per_worker` devices), compute gradients at their own pace; `server_shards` shards
    hold the params and optimizer state and apply each gradient as it arrives (`mode=async`), or the mean of one
    gradient per worker (`mode=sync`, the lockstep baseline)."""

    section: ClassVar[str] = "engine"

    kind: str = setting("spmd", "spmd: one program over the mesh; ray: parameter-server workers", choices=ENGINES)
    mode: str = setting(
        "async", "ray: async applies each gradient on arrival; sync the mean of one per worker", choices=ENGINE_MODES
    )
    workers: int = setting(2, "ray: worker processes computing gradients", at_least=1)
    server_shards: int = setting(1, "ray: parameter-server shards, each holding a part of the params", at_least=1)
    devices_per_worker: int = setting(1, "ray: simulated CPU devices of each worker's mesh (local runs)", at_least=1)
    pull_every: int = setting(1, "ray: a worker pulls fresh params every K of its gradients", at_least=1)
    max_staleness: int = setting(
        -1,
        "ray: a gradient is applied at most this many updates after its params (-1: unbounded); GRPO: a batch of "
        "rollouts is sampled at most this many params versions back (-1: engine.workers - 1)",
        at_least=-1,
    )
    staleness_lr: str = setting(
        "none", "ray: inverse scales each update by 1 / (1 + staleness) (Zhang et al., 2016)", choices=STALENESS_LR
    )
    slow_workers: str = setting(
        "", "I:FACTOR,... worker I (spmd: process I) runs FACTOR x slower, by waiting (tests, benchmarks)"
    )
    worker_restarts: int = setting(3, "ray: dead workers and server shards replaced before the run fails", at_least=0)
    ray_address: str = setting("", "ray: a cluster's address (auto: the one `ray start` began); empty: local Ray")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.slowdowns()  # a malformed engine.slow_workers is refused where it enters

    def slowdowns(self) -> dict[int, float]:
        """`slow_workers` as {worker index: factor}: worker I (with `kind=spmd`, process I) waits until each of its
        gradients (steps) took FACTOR times as long as it computed, as a node FACTOR times slower would (the machine's
        cores are not taken). Under spmd an index beyond the job's processes is refused when the run starts."""
        found = {}
        for item in filter(None, (part.strip() for part in self.slow_workers.split(","))):
            index, _, factor = item.partition(":")
            try:
                worker, slowdown = int(index), float(factor)
            except ValueError:
                worker, slowdown = -1, 0.0
            if worker < 0 or not slowdown >= 1:
                raise ConfigError(
                    f"engine.slow_workers='{self.slow_workers}': '{item}' is not I:FACTOR with a worker index I >= 0 "
                    "and a factor >= 1, e.g. --slow-worker 1:3 (worker 1 three times slower)."
                )
            if self.kind == "ray" and worker >= self.workers:
                raise ConfigError(
                    f"engine.slow_workers='{self.slow_workers}': worker {worker} does not exist with engine.workers="
                    f"{self.workers} (workers are 0..{self.workers - 1})."
                )
            found[worker] = slowdown
        return found


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model_name: str
    model: Any  # the model's own config dataclass
    mesh: str = "data=-1"
    rules: dict[str, str] = dataclasses.field(default_factory=dict)
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    allreduce: AllReduceConfig = AllReduceConfig()
    updates: UpdatesConfig = UpdatesConfig()
    pipeline: PipelineConfig = PipelineConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    engine: EngineConfig = EngineConfig()
    lora: LoraConfig = LoraConfig()
    precision: PrecisionConfig = PrecisionConfig()
    preference: PreferenceConfig = PreferenceConfig()
    grpo: GrpoConfig = GrpoConfig()


SECTIONS = (
    "model",
    "optimizer",
    "data",
    "train",
    "allreduce",
    "updates",
    "pipeline",
    "checkpoint",
    "tracking",
    "engine",
    "lora",
    "precision",
    "preference",
    "grpo",
)


# The data a model trains on by default, by its task; language models take DataConfig()'s.
TASK_DATA = {
    "classification": DataConfig(source="digits", batch_size=64),
    "clicks": DataConfig(source="clicks", batch_size=256),
    "mlm": DataConfig(source="builtin"),  # the builtin text, masked
    "text_classification": DataConfig(source="builtin"),  # the generated sentiment task: every review fits 128 bytes
}


def default_config(model: str = "gpt") -> RunConfig:
    """The preset run for `model` (`gpt`, `gpt-small`, `mlp`, ...)."""
    spec, preset = resolve_model(model)
    data = TASK_DATA.get(spec.task, DataConfig())
    return RunConfig(model_name=f"{spec.name}-{preset}", model=spec.presets[preset](), data=data)


# Keys renamed when TrainConfig was split into the parts each component takes (one word, one meaning: "sync" had
# named the update policy, the all-reduce algorithm and the Ray engine's lockstep mode). Old full key -> new full key.
# Why translate and not refuse: a run's own config.toml and the checkpoints earlier versions wrote (their stored
# config) must keep resuming, and a user's scripts keep working while a notice names the new key.
RENAMED: dict[str, str] = {
    "train.grad_sync": "allreduce.algorithm",
    "train.grad_bucket_mb": "allreduce.bucket_mb",
    "train.ps_servers": "allreduce.hubs",
    "train.grad_compression": "allreduce.compression",
    "train.sync": "updates.policy",
    "train.sync_every": "updates.average_every",
    "train.staleness": "updates.staleness",
    "train.outer_lr": "updates.outer_lr",
    "train.outer_momentum": "updates.outer_momentum",
    "train.schedule": "pipeline.schedule",
    "train.microbatches": "pipeline.microbatches",
    "train.virtual_stages": "pipeline.virtual_stages",
    "train.stage_balance": "pipeline.balance",
    "train.pipeline_stash": "pipeline.stash",
    "train.checkpoint_dir": "checkpoint.dir",
    "train.checkpoint_every": "checkpoint.every",
    "train.checkpoint_keep": "checkpoint.keep",
    "train.checkpoint_keep_every": "checkpoint.keep_every",
    "train.restore": "checkpoint.restore",
    "train.allow_config_change": "checkpoint.allow_change",
    "train.checkpoint_failure": "checkpoint.on_failure",
    "train.metrics_file": "tracking.metrics_file",
    "train.tensorboard_dir": "tracking.tensorboard_dir",
    "train.wandb_project": "tracking.wandb_project",
    "train.wandb_mode": "tracking.wandb_mode",
    "train.wandb_dir": "tracking.wandb_dir",
    "train.profile_steps": "tracking.profile_steps",
    "train.profile_dir": "tracking.profile_dir",
    "engine.ps_shards": "engine.server_shards",
}
# Values renamed with them: (new key, old value) -> new value.
RENAMED_VALUES: dict[tuple[str, str], str] = {("allreduce.algorithm", "parameter_server"): "star"}


def _new_short_names() -> set[str]:
    """The field names of every section but the model's (whose fields depend on the model), from `RunConfig`."""
    parts = [f.default for f in dataclasses.fields(RunConfig) if f.name in SECTIONS and f.name != "model"]
    return {f.name for part in parts for f in dataclasses.fields(part)}


# Old short names (`grad_sync`, `sync`, `checkpoint_dir`) -> new full keys; a short name that is still a field's
# (`staleness`, `schedule`, `restore`) is no old key: it resolves as it is.
_RENAMED_SHORT = {
    old.split(".", 1)[1]: new for old, new in RENAMED.items() if old.split(".", 1)[1] not in _new_short_names()
}


def renamed_key(key: str) -> str | None:
    """The new full key of old key `key`, given in full (`train.grad_sync`) or short (`grad_sync`, `sync`,
    `checkpoint_dir`) -> `allreduce.algorithm`, `updates.policy`, `checkpoint.dir`; None for a key that is not an
    old one. Files, `key=value` overrides, stored checkpoint configs and `checkpoint.allow_change` translate here."""
    return RENAMED.get(key) or _RENAMED_SHORT.get(key)


def translated(key: str, value: Any, notices: dict[str, str] | None, cfg: RunConfig | None = None) -> tuple[str, Any]:
    """`key` and `value` under their new names where `key` is an old key (else as given); a key that is also one of
    `cfg`'s (a registered model's own field named like an old key) is not translated. With `notices`, the
    translation's one-line notice is recorded there under the old key (each old key once); without, it is silent
    (a stored config)."""
    new = renamed_key(key)
    if new is None or (cfg is not None and _is_key(cfg, key)):
        return key, value
    if notices is not None:
        notices.setdefault(key, f"notice: {key} is now {new} (translated; write the new name)")
    if isinstance(value, str):
        value = RENAMED_VALUES.get((new, value), value)
    return new, value


def _is_key(cfg: RunConfig, key: str) -> bool:
    """Whether `key` names a field of `cfg`, in full or by its short name."""
    return any(key in (full, full.split(".", 1)[1]) for full in _all_keys(cfg))


def _print_notices(notices: dict[str, str]) -> None:
    for line in notices.values():
        print(line, file=sys.stderr)


CONFIG_FILE = "config.toml"  # the name of the resolved config a run writes into its checkpoint directory
MESH_HELP = "a layout name in meshes/, a .toml layout path, or inline axis sizes such as data=2,tensor=4"
RULE_TABLES = ("params", "activations")  # rules.NAME sets both tables; rules.params.NAME one of them

# (key, value) pairs: "section.field", "mesh" or "rules.NAME", each value of its field's type.
Changes = list[tuple[str, Any]]


def load_config(path: str | Path | None = None, model: str | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run config of `model`'s preset (else the file's `model_name`, else gpt), then the TOML file at `path`,
    then `overrides` (`key=value` strings). Raises `ConfigError` for any unknown key or bad value, before anything
    is built.

    >>> cfg = load_config("runs/x/ckpt/config.toml", overrides=["checkpoint.dir=runs/y"])   # doctest: +SKIP
    """
    table = read_config_file(path) if path is not None else {}
    cfg = default_config(model) if model else _file_preset(table, path)
    notices: dict[str, str] = {}
    from_file = _checked(cfg, list(_file_changes(cfg, table, path, notices)), f"config file '{path}'") if path else []
    changes = [*from_file, *override_changes(cfg, overrides, notices)]
    _print_notices(notices)  # one per old key, though the file and the command line both name it
    return _apply(cfg, changes)


def config_from_table(table: dict[str, Any], source: str) -> RunConfig:
    """The run config that `table` describes, in the shape a run config file has (`config_table`'s; also the JSON a
    checkpoint's meta stores): its `model_name`'s preset, then the table's keys. `source` names it in errors. Keys
    renamed since the table was written (`RENAMED`) are translated silently: a checkpoint keeps resuming."""
    cfg = _file_preset(table, source)
    return _apply(cfg, _checked(cfg, list(_file_changes(cfg, table, source)), f"config file '{source}'"))


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """Apply `key=value` strings. Keys: a field name if unique (`n_layers`), or `section.field`; `rules.NAME=axes`.

    All overrides of a section are applied together and then checked, so `n_heads=6 d_model=48` holds although
    the preset's d_model is not divisible by 6; a later override of the same key wins."""
    return _apply(cfg, override_changes(cfg, overrides))


def override_changes(cfg: RunConfig, overrides: Sequence[str], notices: dict[str, str] | None = None) -> Changes:
    """`key=value` strings as checked changes of `cfg`; a `ConfigError` names every bad value. An old key
    (`RENAMED`) is translated, with a notice naming the new one: added to `notices`, or without, printed on stderr."""
    changes, printed = [], notices is None
    notices = {} if notices is None else notices
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not key=value.")
        key, text = translated(key.strip(), text, notices, cfg)
        if key == "mesh" or key.startswith("rules."):
            changes.append((key, text))
            continue
        section, name = resolve_key(cfg, key)
        changes.append((f"{section}.{name}", _parse_text(text, getattr(cfg, section), name, f"{section}.{name}")))
    if printed:
        _print_notices(notices)
    return _checked(cfg, changes)


def _all_keys(cfg: RunConfig) -> list[str]:
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))]


def resolve_key(cfg: RunConfig, key: str) -> tuple[str, str]:
    """`n_layers` or `model.n_layers` -> ("model", "n_layers"); unknown keys list close matches."""
    full_keys = _all_keys(cfg)
    if "." in key and key in full_keys:
        section, name = key.split(".", 1)
        return section, name
    owners = [k for k in full_keys if k.split(".", 1)[1] == key]
    if len(owners) == 1:
        section, name = owners[0].split(".", 1)
        return section, name
    if len(owners) > 1:
        raise ConfigError(f"override '{key}' is ambiguous: say which of {', '.join(owners)}.")
    close = close_keys(cfg, key)
    hint = f" Did you mean: {', '.join(close)}?" if close else " Run with --help-config to list every key."
    raise ConfigError(f"unknown config key '{key}'.{hint}")


def close_keys(cfg: RunConfig, key: str) -> list[str]:
    """The keys of `cfg` closest to unknown `key`, best first: the same field in another section (`train.dtype` ->
    `model.dtype`), then similar spellings."""
    full_keys = _all_keys(cfg)
    moved = [k for k in full_keys if "." in key and k.split(".", 1)[1] == key.split(".", 1)[1]]
    candidates = full_keys + [k.split(".", 1)[1] for k in full_keys]
    return [*moved, *(k for k in difflib.get_close_matches(key, candidates, n=4, cutoff=0.6) if k not in moved)][:4]


def _parse_text(text: str, part: Any, name: str, key: str) -> Any:
    """`text` as the declared type of field `name` of config `part` (`key` when named in an error); fields of
    other types (tuples) take the text and parse it themselves."""
    kind = _kind(part, name)
    try:
        if kind is bool:
            return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[text.lower()]
        if kind in (int, float):
            return kind(text)
    except (KeyError, ValueError):
        raise ConfigError(f"{problem(key, text, accepts_of(part.__dataclass_fields__[name]), kind)}.") from None
    return text


def _checked(cfg: RunConfig, changes: Changes, source: str = "") -> Changes:
    """`changes` if every value is of its field's type and within its declaration; else a `ConfigError` naming
    each bad one (and `source`, where they come from)."""
    problems = [found for key, value in changes if (found := _problem(cfg, key, value))]
    if problems:
        raise ConfigError(f"{source + ': ' if source else ''}{'; '.join(problems)}.")
    return changes


def _problem(cfg: RunConfig, key: str, value: Any) -> str | None:
    """What is wrong with `value` for `key`, or None."""
    if key.startswith("rules."):  # text: an override's, or a file's axes as `_rule_changes` joined them
        return None
    if key == "mesh":
        return None if isinstance(value, str) else f"mesh={value!r}: expected a string ({MESH_HELP})"
    section, name = key.split(".", 1)
    part = getattr(cfg, section)
    kind, accepts = _kind(part, name), accepts_of(part.__dataclass_fields__[name])
    return None if kind is None or accepts.accepts(value, kind) else problem(key, repr(value), accepts, kind)


def _apply(cfg: RunConfig, changes: Changes) -> RunConfig:
    """`cfg` with `changes` (a later change of a key wins), each section's checked together."""
    sections: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in changes:
        if key == "mesh":
            top["mesh"] = value
        elif key.startswith("rules."):
            top["rules"] = {**top.get("rules", cfg.rules), key.removeprefix("rules."): value}
        else:
            section, name = key.split(".", 1)
            sections[section][name] = value
    parts = {section: _replace(getattr(cfg, section), given) for section, given in sections.items() if given}
    return dataclasses.replace(cfg, **top, **parts)


def _replace(part: Any, changes: dict[str, Any]) -> Any:
    """`part` with `changes`, checked together (by `Settings`, and by a registered model's own `__post_init__`)."""
    try:
        return dataclasses.replace(part, **changes)
    except UserInputError:  # says what is wrong already
        raise
    except (TypeError, ValueError) as err:  # a model config that checks itself with Python's errors
        given = " ".join(f"{name}={value}" for name, value in changes.items())
        raise ConfigError(f"overrides {given}: {err}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The TOML table of run config file `path`; a missing, unreadable or malformed file is a `ConfigError` naming
    it (TOML's message gives the line and column)."""
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        raise ConfigError(
            f"config file '{path}': run configs are TOML, not YAML (YAML 1.1 reads 1e-3 as a string and no as false). "
            "`jaxtrain train --model NAME --help-config > run.toml` writes every key to start from."
        )
    text = utf8_text(read_bytes(path, "config file", ConfigError), path, "config file", ConfigError)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}.") from None


def _file_preset(table: dict[str, Any], path: str | Path | None) -> RunConfig:
    """The preset the file's `model_name` names (gpt without one)."""
    name = table.get("model_name", "gpt")
    if not isinstance(name, str):
        raise ConfigError(f"config file '{path}': model_name={name!r}: expected a model name such as \"gpt-tiny\".")
    try:
        return default_config(name)
    except UserInputError as err:
        raise ConfigError(f"config file '{path}': model_name={name!r}: {err}") from None


def _file_changes(
    cfg: RunConfig, table: dict[str, Any], path: str | Path, notices: dict[str, str] | None = None
) -> Iterator[tuple[str, Any]]:
    """The changes the TOML `table` of file `path` makes to `cfg`, by key; `model_name` has chosen `cfg` already.
    Unknown keys are a `ConfigError` naming the file and the closest keys. Old keys are translated (`translated`:
    with a notice in `notices`, if given)."""
    for key, value in table.items():
        if key in SECTIONS or key == "rules":
            if not isinstance(value, dict):
                raise ConfigError(f"config file '{path}': {key}={value!r}: expected a table ([{key}]) of keys.")
            yield from (
                _rule_changes(value, path) if key == "rules" else _section_changes(cfg, key, value, path, notices)
            )
        elif isinstance(value, dict):
            close = difflib.get_close_matches(key, [*SECTIONS, "rules"], n=2)
            hint = f" Did you mean [{close[0]}]?" if close else f" Tables: {', '.join(SECTIONS)}, rules."
            raise ConfigError(f"config file '{path}': unknown table [{key}].{hint}")
        elif key != "model_name":
            key, value = translated(key, value, notices, cfg)
            yield _file_key(cfg, key, value, path), value


def _section_changes(
    cfg: RunConfig, section: str, table: dict[str, Any], path: str | Path, notices: dict[str, str] | None
) -> Iterator[tuple[str, Any]]:
    for name, value in table.items():
        old, value = translated(f"{section}.{name}", value, notices, cfg)
        key = _file_key(cfg, old, value, path)
        part, field = key.split(".", 1)
        yield key, float(value) if _kind(getattr(cfg, part), field) is float and type(value) is int else value


def _file_key(cfg: RunConfig, key: str, value: Any, path: str | Path) -> str:
    """The full key of `key` as a file names it (a dotted key, or a short name as overrides take it)."""
    if key == "mesh":
        return key
    try:
        return ".".join(resolve_key(cfg, key))
    except ConfigError as err:
        close = close_keys(cfg, key)
        best = ".".join(resolve_key(cfg, close[0])) if close else ""
        takes = f" ({best} takes {describe_field(*_field(cfg, best))})" if best else ""
        raise ConfigError(f"config file '{path}': {key} = {value!r}: {str(err).rstrip('.?')}?{takes}") from None


def _field(cfg: RunConfig, key: str) -> tuple[type, dataclasses.Field]:
    section, name = key.split(".", 1)
    part = getattr(cfg, section)
    return type(part), part.__dataclass_fields__[name]


def _kind(part: Any, name: str) -> type | None:
    return scalar_types(type(part)).get(name)


def _rule_changes(table: dict[str, Any], path: str | Path, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """`[rules]` entries as `rules.NAME` changes: a value is mesh axes, as a comma-separated string or a list;
    `[rules.params]` and `[rules.activations]` tables set one table's rules."""
    for name, value in table.items():
        if isinstance(value, dict) and not prefix and name in RULE_TABLES:
            yield from _rule_changes(value, path, f"{name}.")
        elif isinstance(value, list) and all(isinstance(axis, str) for axis in value):
            yield f"rules.{prefix}{name}", ",".join(value)
        elif isinstance(value, str):
            yield f"rules.{prefix}{name}", value
        else:
            tables = "" if prefix else "; or a [rules.params] or [rules.activations] table"
            raise ConfigError(
                f"config file '{path}': rules.{prefix}{name}={value!r}: expected mesh axes, \"fsdp,tensor\" or "
                f'["fsdp", "tensor"] ("" replicates){tables}.'
            )


class ConfigWriteError(UserInputError):
    """The resolved run config could not be written beside the checkpoints."""


def config_table(cfg: RunConfig) -> dict[str, Any]:
    """`cfg` as the TOML table a run config file holds (what `load_config` reads back to `cfg`)."""
    table: dict[str, Any] = {"model_name": cfg.model_name, "mesh": cfg.mesh}
    for section in SECTIONS:
        part = getattr(cfg, section)
        table[section] = {
            f.name: _toml_value(getattr(part, f.name), f"{section}.{f.name}") for f in dataclasses.fields(part)
        }
    if cfg.rules:
        table["rules"] = dict(cfg.rules)
    return table


def _toml_value(value: Any, key: str) -> Any:
    if isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return list(value)
    raise ConfigError(
        f"{key}={value!r} has no form in a TOML run config (strings, numbers, booleans and lists of them have): "
        "give the field a default of one of those types."
    )


def write_config(cfg: RunConfig) -> Path | None:
    """Write `cfg` as `config.toml` into its checkpoint directory, atomically (a reader sees the old file or the new
    one, never part of one), so that `jaxtrain train --config <it>` reruns the run. None without a directory."""
    if not cfg.checkpoint.dir:
        return None
    path = Path(cfg.checkpoint.dir) / CONFIG_FILE
    header = (
        f"# The resolved config of the run in {path.parent}, as its latest start wrote it.\n"
        f"# Rerun it: jaxtrain train --config {path} [--checkpoint-dir ANOTHER] [key=value ...]\n"
    )
    temporary = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    try:
        temporary.write_text(header + tomli_w.dumps(config_table(cfg)), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise ConfigWriteError(f"cannot write the run config {path}: {err.strerror or err}.") from None
    return path


def describe_config(cfg: RunConfig) -> str:
    """Every key with its value, type, what it accepts, a line of help and the preset's default where the value
    differs (what --help-config prints). It is TOML: saved to a file, it is a run config of `cfg`."""
    defaults = default_config(cfg.model_name)
    lines = [
        f"# Every config key of {cfg.model_name}, with its type, what it accepts and its value (marked where it is",
        "# not the preset's default). Give them in a TOML file (--config run.toml, in this shape or with [section]",
        "# tables) or as key=value (train.steps=10, or steps=10 where the name is unique); lowest first: the preset,",
        "# the file, the flags, key=value.",
        *_described("model_name", cfg.model_name, "str: the model and preset (--model); it sets every default", None),
        *_described("mesh", cfg.mesh, f"str: {MESH_HELP}", defaults.mesh),
    ]
    for section in SECTIONS:
        part, preset = getattr(cfg, section), getattr(defaults, section)
        lines.append(f"\n# [{section}] {type(part).__name__}")
        for field in dataclasses.fields(part):
            what = describe_field(type(part), field)
            lines += _described(f"{section}.{field.name}", getattr(part, field.name), what, getattr(preset, field.name))
    lines.append(
        '\n# [rules] logical name -> mesh axes ("" replicates); rules.params.NAME or rules.activations.NAME set one'
    )
    lines += [f"rules.{_toml_key(name)} = {_toml_text(axes)}" for name, axes in cfg.rules.items()]
    return "\n".join(lines)


def _described(key: str, value: Any, what: str, default: Any) -> list[str]:
    changed = default is not None and value != default
    mark = f"  # default {_toml_text(_toml_value(default, key))}" if changed else ""
    return [f"# {what}", f"{key} = {_toml_text(_toml_value(value, key))}{mark}"]


def _toml_text(value: Any) -> str:
    """`value` as TOML writes it."""
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


def _toml_key(name: str) -> str:
    """A rule name as a TOML dotted key: bare parts, or one quoted key where a part is not bare."""
    bare = all(part and part.replace("_", "").replace("-", "").isalnum() for part in name.split("."))
    return name if bare else _toml_text(name)
