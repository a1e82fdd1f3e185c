"""jaxtrain's own models, registered on import (`jaxtrain.registry`; the library finds this package through the
`jaxtrain.models` entry point in pyproject.toml and never imports it). The folder is models/ in a checkout and
installs as the package `jaxtrain_models`, a name no other project's `models` collides with; its modules import each
other relatively, so the folder does not depend on the name it is imported under.

Each model is a plain Flax NNX module with a `loss(batch) -> (loss, metrics)` method, a frozen config dataclass
with `train_flops(batch_size, seq_len, weight_gradients=True)`, and named presets. Nothing here knows about meshes.
"""

from jaxtrain.registry import register_model

from . import alphazero, bert, gpt, llama, mlp, moe, recsys, resnet

register_model("gpt", gpt.GPT, gpt.PRESETS, task="lm", default_preset="cpu")
register_model("llama", gpt.GPT, llama.PRESETS, task="lm", default_preset="cpu")
register_model("mlp", mlp.MLP, mlp.PRESETS, task="classification", default_preset="digits")
register_model("resnet", resnet.ResNet, resnet.PRESETS, task="classification", default_preset="digits")
register_model("recsys", recsys.DLRM, recsys.PRESETS, task="clicks", default_preset="tiny")
register_model("moe", moe.MoE, moe.PRESETS, task="lm", default_preset="tiny")
register_model("bert", bert.MaskedLM, bert.PRESETS, task="mlm", default_preset="tiny")
register_model(
    "bert_classifier", bert.Classifier, bert.CLASSIFIER_PRESETS, task="text_classification", default_preset="tiny"
)
register_model("alphazero", alphazero.AlphaZeroNet, alphazero.PRESETS, task="custom", default_preset="connect4")
