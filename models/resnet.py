"""A ResNet image classifier (He et al. 2015): BasicBlock or Bottleneck residual blocks, any number of stages.

Hybrid parallelism through names only. Convolutions have few weights and most of the compute, so their kernels
(`conv_in`, `conv_out`) are replicated and their activations' batch dim (`conv_batch`) is split over every mesh
axis, `tensor` included: data parallelism on all devices, the kernels' gradients summed over all of them. The
fully connected head has the parameters, so its input dim (`pooled`) is split over `tensor`: before the head the
pooled features move from "examples split over all devices" to "examples over the data axes, channels over
`tensor`", each device multiplies its slice of the head, and the partial logits are summed over `tensor`
(Krizhevsky's "one weird trick", 2014).

Batch norm normalises with the statistics of the whole global batch: the mean over the batch dim of an array split
over devices is a global mean (the compiler adds the all-reduce), so every device count gives the same numbers.

Known limitation: there are no running averages. The framework's train state holds params, optimizer state and a
step, nothing mutable, so batch norm uses the current batch's statistics in evaluation too: a prediction depends on
the other examples of its batch (negligible for batches of dozens of images; do not evaluate one image at a time).

Inputs arrive flattened, (B, H * W * C) (the digits source gives (B, 64)); the model reshapes them to NHWC and can
upsample them (nearest neighbour) first, so 8x8 digits can feed the 32x32 CIFAR-style network.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     model = ResNet(PRESETS["digits"](), nnx.Rngs(0))
    >>> model(jnp.zeros((4, 64))).shape
    (4, 10)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.errors import ConfigError, UserInputError
from jaxtrain.settings import COMPUTE_DTYPES, Settings, setting
from jaxtrain.sharding.constraints import constrain

BLOCKS = ("basic", "bottleneck")
STEMS = ("cifar", "imagenet")  # cifar: one 3x3 conv; imagenet: a 7x7 conv with stride 2, then a 3x3 max pool
BOTTLENECK_EXPANSION = 4  # a bottleneck block's output has 4x its inner width


class ImageShapeError(UserInputError):
    """A batch whose examples are not the images the model's config describes."""


class ConvSpec(NamedTuple):
    """One convolution (always followed by batch norm; no bias): a k x k kernel from c_in to c_out channels."""

    kernel: int
    c_in: int
    c_out: int
    stride: int = 1

    def out_size(self, size: int) -> int:
        return (size + 2 * (self.kernel // 2) - self.kernel) // self.stride + 1


MAX_POOL = ConvSpec(3, 0, 0, 2)  # the imagenet stem's max pool: a 3x3 window, stride 2, padded by 1; no weights


def max_pool(x: jax.Array) -> jax.Array:  # x: (B, H, W, C) -> (B, H / 2, W / 2, C)
    k, s, p = MAX_POOL.kernel, MAX_POOL.stride, MAX_POOL.kernel // 2
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, k, k, 1), (1, s, s, 1), ((0, 0), (p, p), (p, p), (0, 0)))


class BlockSpec(NamedTuple):
    """A residual block: the main path's convolutions in order, and the shortcut's projection (None: identity)."""

    main: tuple[ConvSpec, ...]
    shortcut: ConvSpec | None


def block_spec(block: str, c_in: int, width: int, stride: int) -> BlockSpec:
    """basic: 3x3 (stride), 3x3. bottleneck: 1x1, 3x3 (stride, as torchvision's "v1.5"), 1x1 to 4 x width.
    A projection shortcut (1x1 conv) where the shape changes."""
    if block == "basic":
        main = (ConvSpec(3, c_in, width, stride), ConvSpec(3, width, width))
    else:
        out = width * BOTTLENECK_EXPANSION
        main = (ConvSpec(1, c_in, width), ConvSpec(3, width, width, stride), ConvSpec(1, width, out))
    c_out = main[-1].c_out
    shortcut = ConvSpec(1, c_in, c_out, stride) if stride != 1 or c_in != c_out else None
    return BlockSpec(main, shortcut)


def _as_int_tuple(value: object, name: str) -> tuple[int, ...]:
    """A tuple of ints from a tuple or from a command-line string such as "2,2,2"."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        result = tuple(int(v) for v in items)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ConfigError(f"model.{name}={value!r}: expected comma-separated integers, e.g. {name}=2,2,2.") from None
    if not result or min(result) < 1:
        raise ConfigError(f"model.{name}={value!r}: expected one or more positive integers, e.g. {name}=2,2,2.")
    return result


@dataclasses.dataclass(frozen=True)
class ResNetConfig(Settings):
    section: ClassVar[str] = "model"

    image_size: int = setting(8, "the data's images: image_size x image_size x channels, flattened", at_least=1)
    channels: int = setting(1, "colour channels of the images", at_least=1)
    # Nearest-neighbour upsampling the model applies first (8x8 digits -> 32x32 with 4).
    upsample: int = setting(1, "upsampling factor applied first", at_least=1)
    stem: str = setting("cifar", "cifar: one 3x3 conv; imagenet: 7x7 stride 2, then a max pool", choices=STEMS)
    block: str = setting("basic", "residual block kind", choices=BLOCKS)
    stage_sizes: tuple[int, ...] = (1, 1, 1)  # blocks per stage; every stage after the first halves H and W
    # The first stage's width (a bottleneck's inner width); each later stage doubles it.
    width: int = setting(32, "the first stage's width", at_least=1)
    n_classes: int = setting(10, "classes the labels take", at_least=1)
    dtype: str = setting("float32", "compute dtype; params, batch-norm statistics stay float32", choices=COMPUTE_DTYPES)

    def __post_init__(self):
        # Frozen: set the parsed tuple through object.__setattr__ (a command-line override arrives as a string).
        object.__setattr__(self, "stage_sizes", _as_int_tuple(self.stage_sizes, "stage_sizes"))
        super().__post_init__()

    @property
    def widths(self) -> tuple[int, ...]:
        """Each stage's width."""
        return tuple(self.width * 2**stage for stage in range(len(self.stage_sizes)))

    @property
    def in_features(self) -> int:
        return self.image_size * self.image_size * self.channels

    @property
    def stem_conv(self) -> ConvSpec:
        if self.stem == "cifar":
            return ConvSpec(3, self.channels, self.width)
        return ConvSpec(7, self.channels, self.width, 2)

    def blocks(self) -> Iterator[BlockSpec]:
        """Every residual block in order."""
        c_in = self.width
        for stage, (n_blocks, width) in enumerate(zip(self.stage_sizes, self.widths)):
            for i in range(n_blocks):
                spec = block_spec(self.block, c_in, width, 2 if stage > 0 and i == 0 else 1)
                c_in = spec.main[-1].c_out
                yield spec

    @property
    def head_features(self) -> int:
        return self.widths[-1] * (BOTTLENECK_EXPANSION if self.block == "bottleneck" else 1)

    def convs(self) -> Iterator[tuple[ConvSpec, int]]:
        """Every convolution with its output's height (= width), in the order the forward pass runs them."""
        size = self.stem_conv.out_size(self.image_size * self.upsample)
        yield self.stem_conv, size
        if self.stem == "imagenet":
            size = MAX_POOL.out_size(size)
        for spec in self.blocks():
            block_in = size
            for conv in spec.main:
                size = conv.out_size(size)
                yield conv, size
            if spec.shortcut:
                yield spec.shortcut, spec.shortcut.out_size(block_in)

    def num_params(self) -> int:
        """Kernels, each conv's batch-norm scale and bias, and the head's weights and bias."""
        convs = sum(c.kernel**2 * c.c_in * c.c_out + 2 * c.c_out for c, _ in self.convs())
        return convs + (self.head_features + 1) * self.n_classes

    def forward_macs(self) -> int:
        """Multiply-accumulates of one image's forward pass: convolutions and the head (what papers call FLOPs)."""
        convs = sum(size * size * c.kernel**2 * c.c_in * c.c_out for c, size in self.convs())
        return convs + self.head_features * self.n_classes

    def train_flops(self, batch_size: int, seq_len: int = 1, weight_gradients: bool = True) -> float:
        """Model FLOPs of one training step: 2 FLOPs per multiply-accumulate, forward + backward = 3 x forward (2 x
        without the weights' gradients)."""
        return (4.0 + 2.0 * weight_gradients) * self.forward_macs() * batch_size


PRESETS = {
    # 8x8 digits: three stages at 8x8, 4x4, 2x2; 0.31M params.
    "digits": lambda: ResNetConfig(),
    # ResNet-20 of the CIFAR paper (3 stages of 3 basic blocks, 16/32/64 wide) on 32x32 images: by default the 8x8
    # digits upsampled 4x; for real 32x32 RGB data set image_size=32 upsample=1 channels=3.
    "cifar": lambda: ResNetConfig(upsample=4, stage_sizes=(3, 3, 3), width=16),
    # ImageNet shapes (224x224 RGB, 1000 classes), for planning: 11.7M and 25.6M params as torchvision's.
    "18": lambda: ResNetConfig(
        image_size=224,
        channels=3,
        stem="imagenet",
        stage_sizes=(2, 2, 2, 2),
        width=64,
        n_classes=1000,
    ),
    "50": lambda: ResNetConfig(
        image_size=224,
        channels=3,
        stem="imagenet",
        block="bottleneck",
        stage_sizes=(3, 4, 6, 3),
        width=64,
        n_classes=1000,
    ),
}


class Conv(nnx.Module):
    """A k x k convolution without bias (batch norm follows). Kernel: HWIO."""

    def __init__(self, spec: ConvSpec, rngs: nnx.Rngs):
        shape = (spec.kernel, spec.kernel, spec.c_in, spec.c_out)
        std = (2.0 / (spec.kernel**2 * spec.c_in)) ** 0.5  # He init for ReLU
        # The window dims have no name: nothing would be gained by splitting a 3x3 window.
        self.kernel = nnx.Param(
            jax.random.normal(rngs.params(), shape) * std, out_sharding=(None, None, "conv_in", "conv_out")
        )
        self.stride, self.pad = spec.stride, spec.kernel // 2

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (B, H, W, C_in) -> (B, H', W', C_out)
        return jax.lax.conv_general_dilated(
            x,
            self.kernel[...].astype(x.dtype),
            window_strides=(self.stride, self.stride),
            padding=((self.pad, self.pad), (self.pad, self.pad)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )


class BatchNorm(nnx.Module):
    """Normalise each channel by its mean and variance over the whole batch and all positions, then scale and shift."""

    def __init__(self, channels: int, eps: float = 1e-5):
        self.scale = nnx.Param(jnp.ones((channels,)), out_sharding=("norm",))
        self.bias = nnx.Param(jnp.zeros((channels,)), out_sharding=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (B, H, W, C)
        x32 = x.astype(jnp.float32)
        # Two passes, not E[x^2] - E[x]^2: the same numbers as one device need the better-conditioned variance.
        mean = jnp.mean(x32, axis=(0, 1, 2))  # (C,): over the global batch, however it is split
        var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))  # (C,)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...] + self.bias[...]).astype(x.dtype)


class ConvNorm(nnx.Module):
    """Convolution, then batch norm."""

    def __init__(self, spec: ConvSpec, rngs: nnx.Rngs):
        self.conv = Conv(spec, rngs)
        self.norm = BatchNorm(spec.c_out)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.conv(x))


class ResidualBlock(nnx.Module):
    """relu(main(x) + shortcut(x)); the main path is ConvNorm layers with a ReLU between each (basic or bottleneck,
    see `block_spec`), the shortcut the identity or a 1x1 projection."""

    def __init__(self, spec: BlockSpec, rngs: nnx.Rngs):
        self.main = nnx.List([ConvNorm(conv, rngs) for conv in spec.main])
        self.shortcut = ConvNorm(spec.shortcut, rngs) if spec.shortcut else None

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (B, H, W, C_in) -> (B, H / stride, W / stride, C_out)
        h = x
        for layer in self.main[:-1]:
            h = jax.nn.relu(layer(h))
        h = self.main[-1](h)
        skip = self.shortcut(x) if self.shortcut is not None else x
        return constrain(jax.nn.relu(h + skip), ("conv_batch", None, None, "conv_out"))


class ResNet(nnx.Module):
    """Stem, residual blocks, global average pool, fully connected head."""

    def __init__(self, cfg: ResNetConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.stem = ConvNorm(cfg.stem_conv, rngs)
        self.blocks = nnx.List([ResidualBlock(spec, rngs) for spec in cfg.blocks()])
        c, n = cfg.head_features, cfg.n_classes
        self.head_kernel = nnx.Param(
            jax.random.normal(rngs.params(), (c, n)) * c**-0.5, out_sharding=("pooled", "classes")
        )
        self.head_bias = nnx.Param(jnp.zeros((n,)), out_sharding=("classes",))

    def images(self, x: jax.Array) -> jax.Array:
        """(B, H * W * C) flattened images -> (B, H', W', C) NHWC in the compute dtype, upsampled."""
        cfg = self.cfg
        if x.ndim != 2 or x.shape[1] != cfg.in_features:
            raise ImageShapeError(
                f"resnet expects flattened {cfg.image_size}x{cfg.image_size}x{cfg.channels} images, "
                f"(batch, {cfg.in_features}), but the batch's x has shape {x.shape}. Set model.image_size and "
                "model.channels to the data's images."
            )
        x = x.reshape(-1, cfg.image_size, cfg.image_size, cfg.channels).astype(jnp.dtype(cfg.dtype))
        x = constrain(x, ("conv_batch", None, None, None))  # from here on every device convolves its own examples
        return jnp.repeat(jnp.repeat(x, cfg.upsample, axis=1), cfg.upsample, axis=2)  # (B, H', W', C)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (B, H * W * C) -> logits (B, classes) float32
        h = jax.nn.relu(self.stem(self.images(x)))  # (B, H, W, C0)
        if self.cfg.stem == "imagenet":
            h = max_pool(h)
        for block in self.blocks:
            h = block(h)
        pooled = jnp.mean(h.astype(jnp.float32), axis=(1, 2))  # (B, C)
        # The switch from data to tensor parallelism: each device takes its slice of channels for its slice of the head.
        pooled = constrain(pooled, ("batch", "pooled"))
        logits = pooled @ self.head_kernel[...] + self.head_bias[...]  # (B, classes): partial sums added over tensor
        return constrain(logits, ("batch", "classes"))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean cross-entropy; also reports accuracy. batch: {"x": (B, H * W * C), "y": (B,)}."""
        logits = self(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"accuracy": accuracy}
