"""lm-eval tasks by name: lm-eval's own, or task YAML files in a folder of yours (`include_path`) over local JSON or
JSON-lines data (`dataset_path: json` with `dataset_kwargs: {data_files: ...}`: nothing is downloaded). A name lm-eval
does not know is refused in one line, with close matches, before anything is evaluated; a folder that holds every
task asked for is read alone, without lm-eval's index of its own thousands of task files (seconds to build).

    >>> tasks = load_tasks(["my_choice"], include_path="tests/eval_tasks")                       # doctest: +SKIP
    >>> task_metrics(run_tasks(JaxtrainLM(path="runs/x"), tasks))  # {'val_my_choice_acc': ..., ...}  # doctest: +SKIP
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxtrain.errors import UserInputError

YAML_SUFFIXES = (".yaml", ".yml")


class TaskError(UserInputError):
    """A task lm-eval does not know, a task folder that does not exist, or lm-eval not installed."""


def lm_eval_installed() -> None:
    """Nothing if lm-eval-harness can be imported; else a `TaskError` saying how to install it."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError("evaluating lm-eval tasks needs lm-eval-harness: pip install -e '.[eval]'.") from None


def task_manager(names: Sequence[str], include_path: str | Path | None = None) -> Any:
    """lm-eval's `TaskManager` that knows every task in `names`: `include_path`'s tasks alone when they hold them
    all, else with lm-eval's own. A `TaskError` names a task neither knows."""
    lm_eval_installed()
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).is_dir():
            raise TaskError(f"task folder '{include_path}' does not exist: give a folder of lm-eval task YAML files.")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(_known(local, name) for name in names):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    for name in names:
        if not _known(manager, name):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = f" nor in '{include_path}'" if include_path else ""
            hint = f" (close: {', '.join(close)})" if close else ""
            raise TaskError(
                f"task {name!r} is not a task lm-eval knows{where}{hint}: list them with `lm-eval ls tasks`, or give "
                "the folder of your task's YAML file as include_path."
            )
    return manager


def _known(manager: Any, name: str) -> bool:
    return name in manager.all_tasks or (Path(name).suffix in YAML_SUFFIXES and Path(name).is_file())


def load_tasks(names: Sequence[str], include_path: str | Path | None = None) -> dict[str, Any]:
    """The tasks `names` ask for (a group's or tag's every task), their data read and each prepared as
    `simple_evaluate` prepares it (no few-shot examples unless the task asks for some, lm-eval's few-shot seed):
    lm-eval's `TaskDict`, loaded once and evaluated any number of times."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    loaded = task_manager(names, include_path).load(list(names))
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    return loaded


def run_tasks(lm: Any, loaded: dict[str, Any], limit: int | None = None) -> dict[str, Any]:
    """lm-eval's results of `lm` on the tasks `load_tasks` loaded (at most `limit` documents each), without
    bootstrapped standard errors or per-sample records. lm-eval's `evaluate`, not `simple_evaluate`, which would also
    reseed the process's global random generators (numpy's, torch's) and collect the environment's description
    (PyTorch's, a second or so of subprocesses) at every evaluation of a training run."""
    from lm_eval.evaluator import evaluate

    return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's numeric results as `val_<task>_<metric>` (`_<filter>` after it for a filter other than `none`):
    the names the training loop logs them under; standard errors left out."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filter_name = key.partition(",")  # "acc,none": metric acc, no filter
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if filter_name and numeric and not metric.endswith("_stderr"):
                metrics[f"val_{task}_{metric}" + ("" if filter_name == "none" else f"_{filter_name}")] = float(value)
    return metrics
