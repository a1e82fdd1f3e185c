"""lm-eval-harness on jaxtrain models: a randomly initialised transformers Llama with its own byte-level BPE tokenizer
(beginning-of-text token added as Llama's is; made here, nothing is downloaded), imported with `jaxtrain import-hf`
and exported back with `jaxtrain export-hf`, evaluated on the local tasks of tests/eval_tasks (multiple choice,
generation, rolling perplexity over JSON lines) by lm-eval's `hf` backend on the export and by the `jaxtrain` model
on the import on one device, data=2,tensor=2 and fsdp=4,tensor=2: the same per-sample log-likelihoods (within 1e-4
of `hf`'s), accuracies, greedy flags and generated text. One scoring program compiles per batch shape; a LoRA
checkpoint evaluates as its merged weights; tasks run inside training at the chosen steps without compiling the
train step again; bad input is one line.

Evaluations use max_length=32 on both sides: the rolling texts span several windows and the longest prompts of the
generation task are cut from the left."""

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is imported: local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from conftest import BACKEND_COMPILE  # noqa: E402
from eval_harness import llama_with_tokenizer  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from jaxtrain.errors import ConfigError, UserInputError  # noqa: E402
from jaxtrain.evaluation import in_loop  # noqa: E402
from jaxtrain.evaluation.__main__ import main as cli  # noqa: E402
from jaxtrain.evaluation.harness import JaxtrainLM  # noqa: E402
from jaxtrain.evaluation.tasks import TaskError  # noqa: E402
from jaxtrain.interop.exporting import export_hf  # noqa: E402
from jaxtrain.interop.importing import import_hf  # noqa: E402
from jaxtrain.run_config import apply_overrides, default_config, load_config  # noqa: E402
from jaxtrain.training.loop import train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "tests" / "eval_tasks"  # its YAML files name their data relative to ROOT
CHOICE, ANSWER, TEXT = "jaxtrain_choice", "jaxtrain_answer", "jaxtrain_text"
MAX_LENGTH = 32
MESHES = ("data=1", "data=2,tensor=2", "fsdp=4,tensor=2")  # each takes the first devices it needs
HF_ATOL = 1e-4  # per-sample log-likelihoods against transformers'
MESH_ATOL = 1e-5  # between meshes: the same program, other reductions


def evaluate(model, tasks=(CHOICE, ANSWER, TEXT), **model_args) -> dict:
    """lm-eval's results with per-sample records, from the checkout's root (where the tasks' data paths start)."""
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    with contextlib.chdir(ROOT):
        return simple_evaluate(
            model=model, model_args=model_args or None, tasks=list(tasks), task_manager=manager, bootstrap_iters=0
        )


def hf_results(directory: Path, tasks=(CHOICE, ANSWER, TEXT)) -> dict:
    args = {"pretrained": str(directory), "dtype": "float32", "device": "cpu", "batch_size": 4}
    return evaluate("hf", tasks, **args, max_length=MAX_LENGTH)


def responses(results: dict, task: str) -> list:
    """Each document's responses, in document order: (log-likelihood, greedy) per choice, a text, or a float."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[r[0] for r in s["resps"]] for s in samples]


def log_likelihoods(results: dict, task: str) -> np.ndarray:
    return np.array([[r[0] if isinstance(r, tuple | list) else r for r in doc] for doc in responses(results, task)])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The Llama's directory, its import (a params export, float32) and the import exported back."""
    root = tmp_path_factory.mktemp("eval")
    llama_with_tokenizer(root / "hf")
    import_hf(root / "hf", root / "import", dtype="float32", devices=jax.devices()[:1])
    export_hf(root / "import", root / "exported", devices=jax.devices()[:1])
    return root


@pytest.fixture(scope="module")
def evaluated(imported):
    """Every task's results from the `hf` backend on the export and from the jaxtrain model on each mesh."""
    results = {"hf": hf_results(imported / "exported")}
    for mesh in MESHES:
        lm = JaxtrainLM(path=str(imported / "import"), mesh=mesh, batch_size=4, max_length=MAX_LENGTH)
        results[mesh] = evaluate(lm)
        results[mesh]["lm"] = lm
    return results


def test_choice_log_likelihoods_and_accuracy_equal_hf_on_every_mesh(evaluated):
    theirs = log_likelihoods(evaluated["hf"], CHOICE)
    one_device = log_likelihoods(evaluated["data=1"], CHOICE)
    for mesh in MESHES:
        ours = log_likelihoods(evaluated[mesh], CHOICE)
        hf_error, mesh_error = np.abs(ours - theirs).max(), np.abs(ours - one_device).max()
        print(f"\n{mesh}: max |ours - hf| {hf_error:.2e}, |ours - 1 device| {mesh_error:.2e}")
        np.testing.assert_allclose(ours, theirs, atol=HF_ATOL, rtol=0)
        np.testing.assert_allclose(ours, one_device, atol=MESH_ATOL, rtol=0)
        greedy = [[bool(r[1]) for r in doc] for doc in responses(evaluated[mesh], CHOICE)]
        assert greedy == [[bool(r[1]) for r in doc] for doc in responses(evaluated["hf"], CHOICE)]
        for metric in ("acc,none", "acc_norm,none"):
            assert evaluated[mesh]["results"][CHOICE][metric] == evaluated["hf"]["results"][CHOICE][metric]
    assert np.ptp(theirs) > 1.0  # the choices' log-likelihoods differ: an answer ignoring its input would not pass


def test_greedy_generation_equals_hf_on_every_mesh(evaluated):
    theirs = responses(evaluated["hf"], ANSWER)
    assert any(doc[0] for doc in theirs)  # something was generated before the stop string
    for mesh in MESHES:
        assert responses(evaluated[mesh], ANSWER) == theirs
        assert evaluated[mesh]["results"][ANSWER] == evaluated["hf"]["results"][ANSWER]


def test_rolling_log_likelihoods_equal_hf_on_every_mesh(evaluated, imported):
    theirs = log_likelihoods(evaluated["hf"], TEXT)
    lm = evaluated["data=1"]["lm"]
    texts = [json.loads(line)["text"] for line in (TASK_DIR / "text.jsonl").read_text().splitlines()]
    assert max(len(lm.tok_encode(t)) for t in texts) > 2 * MAX_LENGTH  # the longest text spans three windows
    for mesh in MESHES:
        ours = log_likelihoods(evaluated[mesh], TEXT)
        print(f"\n{mesh}: rolling, max |ours - hf| {np.abs(ours - theirs).max():.2e} (hf's: {theirs.ravel().round(2)})")
        np.testing.assert_allclose(ours, theirs, atol=HF_ATOL, rtol=0)
        ours, hf = evaluated[mesh]["results"][TEXT], evaluated["hf"]["results"][TEXT]
        assert ours["word_perplexity,none"] == pytest.approx(hf["word_perplexity,none"], rel=1e-5)


def test_one_scoring_compile_per_batch_shape(evaluated):
    """Requests of two length buckets over three batches compile the scoring program twice, and again nothing."""
    generator = evaluated["data=1"]["lm"].generator
    lm = JaxtrainLM(generator=generator, batch_size=2, max_length=256)  # a new program: its shapes compile afresh
    rng = np.random.default_rng(0)
    requests = [(None, rng.integers(2, 300, n).tolist(), [5, 6]) for n in (40, 50, 100, 110, 120)]  # 64, 128
    compiles = []

    def listen(event: str, _seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE and kwargs.get("fun_name") == "jit(_score)":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = lm._loglikelihood_tokens(requests)
        assert len(compiles) == 2
        assert lm._loglikelihood_tokens(requests[::-1]) == first[::-1] and len(compiles) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    alone = [lm._loglikelihood_tokens([r])[0][0] for r in requests[:1]]  # a batch of one real row and padding
    assert alone == pytest.approx([first[0][0]], abs=1e-5)


def test_a_lora_checkpoint_evaluates_as_its_merged_weights(imported, evaluated, tmp_path):
    """Two steps of adapters on the import: the checkpoint's log-likelihoods equal the `hf` backend's on its merged
    export, and differ from the import's."""
    overrides = ["lora.rank=4", "steps=2", "batch_size=4", "seq_len=32", "optimizer.learning_rate=0.05"]
    overrides += ["warmup_steps=1", "mesh=data=2", "train.progress=false", f"checkpoint.dir={tmp_path / 'run'}"]
    overrides.append(f"checkpoint.restore={imported / 'import'}")
    cfg = load_config(imported / "import" / "config.toml", overrides=overrides)
    train(cfg, log=lambda *_: None, devices=jax.devices()[:2])
    export_hf(tmp_path / "run", tmp_path / "merged", devices=jax.devices()[:1])
    theirs = log_likelihoods(hf_results(tmp_path / "merged", tasks=[CHOICE]), CHOICE)
    lm = JaxtrainLM(path=str(tmp_path / "run"), mesh="data=2,tensor=2", batch_size=4, max_length=MAX_LENGTH)
    ours = log_likelihoods(evaluate(lm, tasks=[CHOICE]), CHOICE)
    np.testing.assert_allclose(ours, theirs, atol=HF_ATOL, rtol=0)
    assert np.abs(ours - log_likelihoods(evaluated["data=2,tensor=2"], CHOICE)).max() > 1e-3


def test_tasks_run_inside_training_at_the_chosen_steps_without_recompiling(tmp_path):
    """A 4-step run evaluating the multiple-choice and generation tasks every 2 steps (bytes: gpt-tiny on the
    built-in text) logs their metrics at steps 2 and 4; nothing compiles after the first evaluation, the train step
    included."""
    metrics_file = tmp_path / "metrics.jsonl"
    overrides = ["steps=4", "batch_size=8", "seq_len=32", "train.eval_every=2", "train.log_every=2"]
    overrides += [f"train.eval_tasks={CHOICE},{ANSWER}", "train.eval_tasks_every=2", "train.eval_tasks_limit=4"]
    overrides += [f"train.eval_tasks_include_path={TASK_DIR}", f"metrics_file={metrics_file}", "mesh=data=2,tensor=2"]
    overrides.append("train.progress=false")
    cfg = apply_overrides(default_config("gpt-tiny"), overrides)
    compiled: list[str] = []
    counts = {}

    def listen(event: str, _seconds: float, **kwargs) -> None:
        if event == BACKEND_COMPILE:
            compiled.append(kwargs.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with contextlib.chdir(ROOT):
            in_loop.train(
                cfg,
                log=lambda *_: None,
                devices=jax.devices()[:4],
                on_metrics=lambda row: counts.setdefault(row["step"], len(compiled)),
            )
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    evaluated = {row["step"]: row for row in rows if "val_jaxtrain_choice_acc" in row}
    assert sorted(evaluated) == [2, 4]
    for row in evaluated.values():
        assert 0 <= row["val_jaxtrain_choice_acc"] <= 1 and 0 <= row["val_jaxtrain_answer_exact_match"] <= 1
    assert counts[4] == counts[2], f"compiled after the first evaluation: {compiled[counts[2] :]}"
    # The loop compiles two programs of its own (Shardings.compile's `traced`): the train step and the validation step.
    assert compiled.count("jit(traced)") == 2, compiled


def test_a_non_language_model_and_a_mesh_larger_than_the_devices_are_one_line(tmp_path):
    """An MLP's checkpoint; a mesh of 16 devices on 8, given as lm-eval's comma split delivers it; an argument the
    model does not take."""
    mlp = tmp_path / "mlp"
    overrides = ["steps=1", "batch_size=8", "data.source=synthetic", "progress=false", "mesh=data=1"]
    cfg = apply_overrides(default_config("mlp"), [*overrides, f"checkpoint.dir={mlp}"])
    train(cfg, log=lambda *_: None, devices=jax.devices()[:1])
    with pytest.raises(UserInputError, match="holds model mlp-.*, a classification model") as not_lm:
        JaxtrainLM(path=str(mlp))
    with pytest.raises(UserInputError, match=r"'data=2,tensor=8' .* multiplies to 16 devices, but 8") as too_big:
        JaxtrainLM(path=str(mlp), mesh="data=2", tensor=8)
    with pytest.raises(UserInputError, match="model argument 'temperature' is not one the jaxtrain model takes"):
        JaxtrainLM(path=str(mlp), temperature=0.5)
    assert "\n" not in str(not_lm.value) + str(too_big.value)


@pytest.mark.slow  # lm-eval indexes its own 14,000 task files (about 9 s here) before a name can be called unknown
def test_an_unknown_task_is_one_line_before_anything_compiles():
    overrides = ["train.eval_tasks=jaxtrain_choise", f"train.eval_tasks_include_path={TASK_DIR}"]
    with pytest.raises(
        TaskError, match="'jaxtrain_choise' is not a task lm-eval knows .*close: jaxtrain_choice"
    ) as err:
        in_loop.evaluations(apply_overrides(default_config("gpt-tiny"), overrides))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # lm-eval's command line indexes its own 14,000 task files (about 9 s here) before it starts
def test_the_command_line_is_lm_evals_with_the_jaxtrain_model(imported, evaluated, tmp_path, capsys):
    """`python -m jaxtrain.evaluation`: lm-eval's options, the mesh given as lm-eval splits it; the accuracy of the
    Python API's run; a mesh larger than the devices is one line and exit status 2."""
    args = ["--model", "jaxtrain", "--tasks", CHOICE, "--include_path", str(TASK_DIR), "--batch_size", "4"]
    model_args = f"path={imported / 'import'},mesh=data=2,tensor=2,max_length={MAX_LENGTH}"
    with contextlib.chdir(ROOT):
        assert cli([*args, "--model_args", model_args, "--output_path", str(tmp_path / "out")]) == 0
        written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
        assert written["results"][CHOICE]["acc,none"] == evaluated["data=2,tensor=2"]["results"][CHOICE]["acc,none"]
        capsys.readouterr()
        assert cli([*args, "--model_args", f"path={imported / 'import'},mesh=data=4,tensor=4"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: mesh layout 'data=4,tensor=4'")


def test_task_settings_the_loop_would_drop_are_refused():
    """The plain loop, which does not import lm-eval, refuses `train.eval_tasks` (`jaxtrain train` and
    `in_loop.train` run them); a task setting without tasks is refused too. Both before anything is built."""
    cfg = apply_overrides(default_config("gpt-tiny"), [f"train.eval_tasks={CHOICE}"])
    with pytest.raises(ConfigError, match="lm-eval's tasks need its harness.*jaxtrain.evaluation.in_loop.train"):
        train(cfg, log=lambda *_: None)
    cfg = apply_overrides(default_config("gpt-tiny"), ["train.eval_tasks_every=5"])
    with pytest.raises(ConfigError, match="train.eval_tasks_every is set without train.eval_tasks"):
        in_loop.evaluations(cfg)
