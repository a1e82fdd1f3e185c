"""The ResNet: the same training run on hybrid meshes as on one device, the split the compiled program shows
(convolutions data-parallel on every device, head tensor-parallel), published sizes, and learning digits (slow)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from conftest import shared_file
from flax import nnx
from helpers import assert_curves_close, curve, make_run

from jaxtrain.analysis.comm_report import axes_of_group
from jaxtrain.analysis.hlo import collectives
from jaxtrain.run_config import ConfigError, apply_overrides, default_config
from jaxtrain.training.loop import train
from jaxtrain_models.resnet import PRESETS, ImageShapeError, ResNet

HYBRID = "data=4,tensor=2"


def resnet_run(mesh, devices=8, overrides=()):
    # Random images: the same numbers on every mesh need no real data, so these tests run where digits are absent.
    return make_run(mesh, ["data.source=synthetic", "batch_size=16", *overrides], model="resnet", devices=devices)


@pytest.fixture(scope="module")
def single():
    return resnet_run("single", devices=1)


@pytest.fixture(scope="module")
def hybrid():
    return resnet_run(HYBRID)


@pytest.fixture(scope="module")
def initial_params(single):
    """The 1-device run's initial params, in model order. The sharded runs start from them: compiling the random
    initialisation costs seconds per mesh on CPU, and that it gives every mesh the same params is tested for GPT."""
    return jax.device_get(single.shardings.init_state(single.optimizer, single.cfg.train.seed)["params"])


@pytest.mark.parametrize("mesh", [HYBRID, "data=2,fsdp=2,tensor=2"])
def test_losses_match_single_device(mesh, single, hybrid, initial_params):
    sharded = curve(hybrid if mesh == HYBRID else resnet_run(mesh), params=initial_params)
    assert_curves_close(sharded, curve(single, params=initial_params))
    assert sharded["loss"][-1] < sharded["loss"][0]  # it is training, not replaying a constant


def conv_kernels(tree):
    """{path: leaf} of the convolution kernels (4-d params) in a params-shaped tree."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in flat if len(getattr(leaf, "shape", ())) == 4}


def reduced_over(run, kind):
    """{shape: set of mesh-axes tuples} of every array a `kind` collective of the compiled train step computes."""
    found = {}
    for c in collectives(run.train_step.as_text()):
        if c.kind == kind:
            axes = tuple(sorted(set().union(*(axes_of_group(run.shardings.mesh, g) for g in c.groups))))
            for _, shape in c.shapes:
                found.setdefault(shape, set()).add(axes)
    return found


def test_convolutions_are_replicated_and_their_gradients_summed_over_every_device(hybrid):
    kernels = conv_kernels(hybrid.shardings.abstract_state["params"])
    assert len(kernels) == 9  # stem, 2 per block, 2 projection shortcuts
    assert all(all(axis is None for axis in k.sharding.spec) for k in kernels.values())
    # The convolutions' batch is split over data *and* tensor, so each kernel's gradient is summed over both.
    all_reduced = reduced_over(hybrid, "all-reduce")
    for kernel in kernels.values():
        assert ("data", "tensor") in all_reduced.get(kernel.shape, set()), kernel.shape


def test_head_is_split_over_tensor(hybrid):
    head = hybrid.shardings.abstract_state["params"]["head_kernel"]  # (128, 10): (pooled, classes)
    assert tuple(head.sharding.spec) == ("tensor", None)
    compiled_head = hybrid.train_step.input_shardings[0][0]["params"]["head_kernel"]
    assert compiled_head.shard_shape(head.shape) == (64, 10)
    entry = next(line for line in hybrid.train_step.as_text().splitlines() if line.startswith("ENTRY"))
    assert "f32[64,10]" in entry and "f32[128,10]" not in entry  # each device is handed its half only
    # Its gradient is summed over data only, each tensor half apart (XLA reduces it transposed).
    assert reduced_over(hybrid, "all-reduce")[(10, 64)] == {("data",)}
    row = next(line for line in hybrid.shardings.table().splitlines() if line.startswith("head_kernel"))
    assert row.split()[3:7] == ["pooled", "classes", "tensor", "-"]


def test_the_convolutions_are_split_over_all_eight_devices(single, hybrid):
    # Per-device FLOPs: ~1/8 of one device's (the replicated parameters' optimizer update, repeated on every device,
    # keeps it above). With the batch split over data only, both devices of a tensor pair would convolve the same
    # examples: 1/4 at best.
    ratio = single.train_step.cost_analysis()["flops"] / hybrid.train_step.cost_analysis()["flops"]
    assert 6 < ratio <= 8, ratio


def test_imagenet_presets_have_torchvisions_sizes():
    # torchvision's published parameter counts and GFLOPS (multiply-accumulates of one 224x224 image).
    resnet18, resnet50 = PRESETS["18"](), PRESETS["50"]()
    assert resnet18.num_params() == 11_689_512 and resnet50.num_params() == 25_557_032
    assert round(resnet18.forward_macs() / 1e9, 2) == 1.81 and round(resnet50.forward_macs() / 1e9, 2) == 4.09


def test_cifar_preset_upsamples_digits_and_bad_images_are_refused():
    with nnx.use_eager_sharding(False):  # shapes only: eagerly, each new weight shape compiles a random kernel
        model = nnx.eval_shape(lambda: ResNet(PRESETS["cifar"](), nnx.Rngs(0)))
    forward = functools.partial(nnx.eval_shape, lambda m, x: m(x), model)
    assert model.images(jnp.zeros((2, 64))).shape == (2, 32, 32, 1)
    assert forward(jnp.zeros((2, 64))).shape == (2, 10)
    with pytest.raises(ImageShapeError, match=r"8x8x1 images, \(batch, 64\).*shape \(2, 1024\)"):
        forward(jnp.zeros((2, 1024)))


def test_depth_from_the_command_line():
    cfg = apply_overrides(default_config("resnet"), ["stage_sizes=2,2", "width=8"])
    assert cfg.model.widths == (8, 16) and len(list(cfg.model.blocks())) == 4
    with pytest.raises(ConfigError, match="comma-separated integers"):
        apply_overrides(default_config("resnet"), ["stage_sizes=deep"])
    with pytest.raises(ConfigError, match="block='dense' is not one of basic, bottleneck"):
        apply_overrides(default_config("resnet"), ["block=dense"])


@pytest.mark.slow
def test_resnet_reaches_97_percent_on_digits():
    digits = shared_file("digits.csv.gz")
    overrides = [
        f"data.source={digits}",
        f"mesh={HYBRID}",
        "steps=150",
        "batch_size=64",
        "learning_rate=3e-3",
        "weight_decay=1e-4",
        "eval_every=150",
        "eval_batches=5",  # 320 of the 359 held-out images, each once
        "progress=false",
    ]
    summary = train(apply_overrides(default_config("resnet"), overrides), log=lambda *_: None)
    assert summary["val_accuracy"] >= 0.97, summary
