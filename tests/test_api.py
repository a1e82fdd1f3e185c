"""The public API (`import jaxtrain`): a model defined here, registered with `jaxtrain.register_model`, trains on
data=2,tensor=2 with the losses it has on one device; a parameter without logical names is refused, naming it, or
replicated when the model opts in; `jaxtrain.config`'s keywords and its errors; what `import jaxtrain` leaves out."""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_curves_close
from jax.sharding import PartitionSpec

import jaxtrain
from jaxtrain import registry
from jaxtrain.data.datasets import DataError, Digits, TokenWindows
from jaxtrain.run_config import write_config

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
# A small run: 4 steps of 8 sequences of 16 bytes, every step logged.
RUN = dict(steps=STEPS, batch_size=8, seq_len=16, log_every=1, eval_every=STEPS, eval_batches=1, progress=False)
RUN.update(warmup_steps=1, learning_rate=1e-2)


@dataclasses.dataclass(frozen=True)
class BytesLMConfig:
    vocab_size: int = 256
    d_model: int = 16
    d_hidden: int = 32
    name_the_scale: bool = True  # False: the output scale is a parameter without logical names


class BytesLM(nnx.Module):
    """Embedding, one residual MLP, an output scale and a head tied to the embedding: a user's model, with no
    `train_flops` (its FLOPs come from XLA's cost analysis)."""

    def __init__(self, cfg: BytesLMConfig, rngs: nnx.Rngs):
        normal, zeros = nnx.initializers.normal(0.5), nnx.initializers.zeros_init()
        embedding_init = nnx.with_partitioning(normal, ("vocab", "embed"))
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embedding_init, rngs=rngs)
        self.up = nnx.Linear(
            cfg.d_model,
            cfg.d_hidden,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )
        down_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed"))
        self.down = nnx.Linear(cfg.d_hidden, cfg.d_model, use_bias=False, kernel_init=down_init, rngs=rngs)
        scale = jnp.ones((cfg.d_model,))
        self.scale = nnx.Param(scale, out_sharding=("norm",)) if cfg.name_the_scale else nnx.Param(scale)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens = batch["tokens"]  # (B, T + 1)
        x = self.embed(tokens[:, :-1])  # (B, T, D)
        x = x + self.down(jax.nn.gelu(self.up(x)))  # (B, T, D)
        logits = (x * self.scale[...]) @ self.embed.embedding[...].T  # (B, T, V)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == tokens[:, 1:])}


PRESETS = {"tiny": BytesLMConfig, "unnamed": lambda: BytesLMConfig(name_the_scale=False)}


@pytest.fixture(scope="module", autouse=True)
def user_models():
    """The test's models registered as a user would, and the registry as it was afterwards."""
    before = dict(registry._MODELS)
    jaxtrain.register_model("bytes", BytesLM, PRESETS)
    jaxtrain.register_model("bytesreplicated", BytesLM, PRESETS, default_preset="unnamed", replicate_unnamed=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "1e11")  # no peak measurement for the MFU
        yield
    registry._MODELS.clear()
    registry._MODELS.update(before)


def train(model: str, mesh: str, devices: int) -> dict:
    lines = []
    summary = jaxtrain.train(
        jaxtrain.config(model, mesh=mesh, **RUN), log=lines.append, devices=jax.devices()[:devices]
    )
    summary["log"] = "\n".join(lines)
    return summary


def curve(summary: dict) -> dict[str, np.ndarray]:
    assert [r["step"] for r in summary["history"]] == list(range(1, STEPS + 1))
    return {key: np.array([r[key] for r in summary["history"]]) for key in ("loss", "grad_norm")}


@pytest.fixture(scope="module")
def one_device(user_models) -> dict[str, np.ndarray]:
    return curve(train("bytes", "single", devices=1))


def test_a_registered_model_trains_on_data_and_tensor_with_its_one_device_losses(one_device):
    summary = train("bytes-tiny", "data=2,tensor=2", devices=4)
    assert "Mesh data=2 tensor=2: 4 cpu devices" in summary["log"]
    params = summary["run"].shardings.abstract_state["params"]
    assert params["up"]["kernel"].sharding.spec == PartitionSpec(None, "tensor")  # tensor parallel, really
    assert params["embed"]["embedding"].sharding.spec == PartitionSpec("tensor", None)
    assert_curves_close(curve(summary), one_device)
    assert summary["run"].flops_per_step > 0  # no train_flops: XLA's count of the compiled step
    assert np.isfinite(summary["mfu"]) and "val_loss" in summary


def test_a_parameter_without_names_is_refused_naming_it():
    cfg = jaxtrain.config("bytes-unnamed", mesh="data=2,tensor=2", **RUN)
    with pytest.raises(
        jaxtrain.PlacementError, match=r"1 parameter without logical axis names.*'scale' \(16,\)"
    ) as err:
        jaxtrain.train(cfg, log=lambda _: None, devices=jax.devices()[:4])
    assert "out_sharding=" in str(err.value) and "replicate_unnamed=True" in str(err.value)  # how to fix it


def test_a_model_that_opts_in_replicates_its_unnamed_parameters(one_device):
    summary = train("bytesreplicated", "data=2,tensor=2", devices=4)
    params = summary["run"].shardings.abstract_state["params"]
    assert params["scale"].sharding.is_fully_replicated
    assert params["up"]["kernel"].sharding.spec == PartitionSpec(None, "tensor")  # the named ones still sharded
    assert_curves_close(curve(summary), one_device)  # the same model, the same numbers


def test_config_keywords_short_dotted_and_overrides():
    cfg = jaxtrain.config(
        "gpt-tiny",
        mesh="data=2,tensor=2",
        steps=20,
        n_layers=3,
        progress=False,
        rules={"embed": ("fsdp", "tensor"), "params.vocab": ""},
        overrides=["steps=30", "optimizer.beta2=0.99"],
        **{"optimizer.learning_rate": 1e-3},
    )
    assert isinstance(cfg, jaxtrain.RunConfig)
    assert (cfg.mesh, cfg.model.n_layers, cfg.optimizer.learning_rate, cfg.optimizer.beta2) == (
        "data=2,tensor=2",
        3,
        1e-3,
        0.99,
    )
    assert cfg.train.steps == 30 and cfg.train.progress is False  # overrides win over keywords
    assert cfg.rules == {"embed": "fsdp,tensor", "params.vocab": ""}
    assert jaxtrain.config("bytes").model == BytesLMConfig()  # a registered model's default preset
    derived = jaxtrain.config(cfg, mesh="cpu8-data", n_layers=2)  # a config with changes
    assert (derived.mesh, derived.model.n_layers, derived.train.steps) == ("cpu8-data", 2, 30)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"stpes": 20}, "unknown config key 'stpes'. Did you mean: steps"),
        ({"steps": "ten"}, "train.steps=ten: expected an integer >= 1"),
        ({"steps": 2.5}, "train.steps=2.5: expected an integer"),
        ({"dtype": "fp16"}, "model.dtype='fp16' is not one of float32, bfloat16, float16"),
        ({"steps": [20]}, r"config key 'steps' was given \[20\]: give a str, int, float or bool"),
        ({"rules": {"embed": 3}}, "rules: 3 is not mesh axes"),
    ],
)
def test_config_errors_are_the_command_lines(settings, message):
    with pytest.raises(jaxtrain.ConfigError, match=message):
        jaxtrain.config("gpt-tiny", **settings)


def test_unknown_models_and_bad_registrations_say_what_to_do():
    with pytest.raises(jaxtrain.UserInputError, match="unknown model 'bytez'.*Did you mean bytes.*register_model"):
        jaxtrain.config("bytez-tiny")
    with pytest.raises(jaxtrain.UserInputError, match="model 'bytes' has no preset 'tinyy'.*Did you mean tiny"):
        jaxtrain.config("bytes-tinyy")
    bad = [
        (("my-lm", BytesLM, PRESETS), {}, "without '-'"),
        (("lm", BytesLM, PRESETS), {"task": "vision"}, "task='vision' is not one of lm, classification, clicks"),
        (("lm", BytesLMConfig, PRESETS), {}, "is not a model class with a loss"),
        (("lm", BytesLM, {}), {}, "has no presets"),
        (("lm", BytesLM, {"tiny": BytesLMConfig()}), {}, "preset 'tiny'.*but it is not callable"),
        (("lm", BytesLM, {"tiny": dict}), {}, "preset 'tiny'.*but it returns a dict"),
        (("lm", BytesLM, PRESETS), {"default_preset": "huge"}, "default_preset='huge' is not one of tiny, unnamed"),
    ]
    for args, kwargs, message in bad:
        with pytest.raises(jaxtrain.ModelRegistrationError, match=message):
            jaxtrain.register_model(*args, **kwargs)
    assert "lm" not in jaxtrain.available_models() and "bytes" in jaxtrain.available_models()


def test_config_reads_a_run_config_file_then_the_keywords(tmp_path):
    cfg = jaxtrain.config("gpt-tiny", mesh="data=2,tensor=4", steps=7, **{"checkpoint.dir": str(tmp_path / "ckpt")})
    (tmp_path / "ckpt").mkdir()
    written = write_config(cfg)
    assert jaxtrain.config(written) == cfg
    assert jaxtrain.config(str(written), steps=3, overrides=["steps=4"]) == jaxtrain.config(cfg, steps=4)


def test_plan_reports_on_hardware_this_machine_lacks():
    report = jaxtrain.plan(jaxtrain.config("gpt-tiny", mesh="tpu-v5p-128"), chip="v5p", devices=64, check=False)
    assert "mesh 'tpu-v5p-128' (fsdp=16 tensor=4; 64 x v5p)" in report and "verdict: fits" in report


def test_simulated_devices_again_is_harmless_another_count_is_an_error():
    jaxtrain.use_simulated_devices(8)  # what conftest.py set up
    with pytest.raises(jaxtrain.DeviceSetupError, match="4 simulated CPU devices were asked for.*Restart the process"):
        jaxtrain.use_simulated_devices(4)


def test_import_and_help_import_no_jax_and_user_names_survive_the_entry_points():
    """In a fresh process: `import jaxtrain`, `jaxtrain --help` and `jaxtrain train --help` import no JAX; a model
    registered under a shipped model's name before the shipped models load keeps that name."""
    script = textwrap.dedent(
        """
        import contextlib, dataclasses, io, sys
        import jaxtrain
        from jaxtrain.cli import main
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            assert main(["--help"]) == 0
            try:
                main(["train", "--help"])
            except SystemExit as done:
                assert done.code == 0
        assert "jax" not in sys.modules and "flax" not in sys.modules, "imported JAX"

        @dataclasses.dataclass(frozen=True)
        class Config:
            width: int = 4

        class Mine:
            def loss(self, batch):
                return 0.0, {}

        jaxtrain.register_model("gpt", Mine, {"small": Config})
        assert jaxtrain.config("mlp").model_name == "mlp-digits"  # the shipped models load now
        assert jaxtrain.available_models()["gpt"].module is Mine
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def own_tokens(n: int = 4000) -> np.ndarray:
    """Token ids a user has in memory: a repeating pattern over ids 0..49, which a model can learn."""
    return (np.arange(n) * 7 % 50).astype(np.int64)


def test_your_own_token_ids_train_alike_on_one_device_and_a_mesh():
    data = TokenWindows(own_tokens(), seq_len=16, seed=0, vocab_size=256)
    summaries = [
        jaxtrain.train(
            jaxtrain.config("bytes", mesh=mesh, **RUN), log=lambda *_: None, devices=jax.devices()[:n], dataset=data
        )
        for mesh, n in (("single", 1), ("data=2,tensor=2", 4))
    ]
    batch = jax.device_get(summaries[1]["run"].batch("train", 0)["tokens"])
    np.testing.assert_array_equal(batch, data.rows("train", 0, range(8), 8)["tokens"])  # the user's rows, no others
    assert_curves_close(curve(summaries[1]), curve(summaries[0]))
    assert summaries[0]["history"][-1]["loss"] < summaries[0]["history"][0]["loss"]


@pytest.mark.parametrize(
    "dataset, message",
    [
        (
            lambda: TokenWindows(own_tokens(), seq_len=8, seed=0),
            r"gives tokens of shape \(8, 9\), but this run's batch",
        ),
        (
            lambda: TokenWindows(own_tokens() + 250, seq_len=16, seed=0),
            "holds token id 299, but the model's vocab_size",
        ),
        (lambda: TokenWindows(own_tokens().astype(float), 16, 0), "expected a 1-D array of integer token ids"),
        (
            lambda: TokenWindows(own_tokens(), 16, 0, vocab_size=40),
            r"holds token ids 0..49, but the model's vocab_size",
        ),
        (lambda: object(), "dataset object has no task, shapes, rows"),
        (lambda: Digits.__new__(Digits), "is for classification models, but this model needs lm data"),
    ],
)
def test_your_own_dataset_is_checked_against_the_run(dataset, message):
    with pytest.raises(DataError, match=message):
        jaxtrain.train(jaxtrain.config("bytes", mesh="data=8", **RUN), log=lambda *_: None, dataset=dataset())
