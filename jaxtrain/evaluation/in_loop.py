"""lm-eval tasks inside training: `train.eval_tasks=NAME,...` runs them every `train.eval_tasks_every` steps (0: at
each validation, `train.eval_every`) and after the last, on the training mesh with the train state's params, and
logs their metrics as `val_<task>_<metric>` beside the loss (the metrics file, TensorBoard, W&B: the loop's own
recorder). The train step is not touched: the tasks' programs are the scoring and generation programs of
`jaxtrain.evaluation.harness`, compiled at the first evaluation and reused by every later one.

    $ jaxtrain train --model llama-tiny train.eval_tasks=my_choice,my_answer train.eval_tasks_every=100 \
          train.eval_tasks_include_path=my_tasks train.eval_tasks_limit=200

Tasks are checked and their data read before the run compiles; a name lm-eval does not know is one line. A run with
adapters is evaluated through them (the train step's own computation, equal to the merged weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxtrain.data.datasets import Dataset
from jaxtrain.errors import ConfigError
from jaxtrain.evaluation.tasks import load_tasks, run_tasks, task_metrics
from jaxtrain.inference.generate import Generator, generation_shardings
from jaxtrain.posttrain import sft_eval
from jaxtrain.run_config import RunConfig
from jaxtrain.training import loop
from jaxtrain.training.setup import Run

SETTING = loop.EVAL_TASKS_KEY
OPTIONS = ("eval_tasks_every", "eval_tasks_limit", "eval_tasks_include_path")  # what means nothing without tasks


class TaskEval:
    """The tasks `train.eval_tasks` names, as a `jaxtrain.training.loop.Evaluation`: loaded (and checked) before the
    run compiles; the lm-eval model built on the first call, on the run's placement, and given each later call's
    params without compiling again."""

    setting = SETTING

    def __init__(self, cfg: RunConfig):
        t = cfg.train
        loop.refuse_pipeline_mesh(cfg, f"{SETTING}={t.eval_tasks}")
        self.every = t.eval_tasks_every or t.eval_every
        self.limit = t.eval_tasks_limit or None
        self.batch_size = cfg.data.batch_size  # rows per program call: the training batch's, which fits the mesh
        self.tasks = load_tasks(task_names(t.eval_tasks), t.eval_tasks_include_path or None)
        self._lm = None

    def __call__(self, run: Run, params: Any, step: int) -> dict[str, float]:
        """`val_<task>_<metric>` of the params after `step`."""
        return task_metrics(run_tasks(self._model(run, params), self.tasks, self.limit))

    def _model(self, run: Run, params: Any) -> Any:
        """The lm-eval model holding `params` (the train state's, in the model's layer order) where the run holds
        them."""
        params = run.shardings.params_in_model_order(params)
        if self._lm is None:
            from jaxtrain.evaluation.harness import JaxtrainLM  # lm-eval: imported only by runs that evaluate tasks

            generator = Generator(generation_shardings(run.placed), params, run.cfg)
            self._lm = JaxtrainLM(generator=generator, batch_size=self.batch_size)
        else:  # the same programs on new params: no compile, and no copy (they are where the run keeps them)
            generator = self._lm.generator
            generator.params = jax.device_put(params, generator.shardings.state_shardings["params"])
        return self._lm


def task_names(setting: str) -> list[str]:
    """The task names of `train.eval_tasks` (comma-separated)."""
    return [name.strip() for name in setting.split(",") if name.strip()]


def evaluations(cfg: RunConfig) -> list[loop.Evaluation]:
    """The evaluations `cfg` asks for beside the validation loss: the generation score and the tasks, if any."""
    generation = [sft_eval.GenerationEval(cfg)] if cfg.train.generate_eval_every else []
    if task_names(cfg.train.eval_tasks):
        return [*generation, TaskEval(cfg)]
    given = [f"train.{key}" for key in OPTIONS if getattr(cfg.train, key)]
    if given:
        raise ConfigError(
            f"{given[0]} is set without {SETTING}: name the tasks (e.g. {SETTING}=arc_easy), or unset it."
        )
    return generation


def train(
    cfg: RunConfig,
    log: Callable[[str], None] = print,
    devices: Sequence[jax.Device] | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
    dataset: Dataset | None = None,
) -> dict[str, Any]:
    """`jaxtrain.training.loop.train` with the evaluations `cfg` asks for (the generation score of
    `train.generate_eval_every`, the tasks of `train.eval_tasks`), checked before anything compiles."""
    return loop.train(cfg, log, devices, on_metrics, dataset, evaluations=evaluations(cfg))
