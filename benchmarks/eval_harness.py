"""lm-eval log-likelihood requests per second: the `jaxtrain` model on 8 simulated CPU devices against lm-eval's own
`hf` backend (PyTorch, same machine) on the same model exported to Hugging Face.

    python benchmarks/eval_harness.py --requests 256 --batch-size 16 --mesh data=8

A random transformers Llama (`--hidden`, `--layers`) with a byte-level BPE is built here (nothing is downloaded),
imported with `import_hf` and exported back with `export_hf`. `--requests` multiple-choice style requests (a context
of 8 to 40 words, a one-word continuation) go to each backend's `loglikelihood`: once to warm up (jaxtrain compiles
its scoring program there, once per length bucket), then `--repeats` rounds of one timed pass of each backend in turn;
the median pass gives requests/s. The compiles of the scoring program are counted in both phases (the timed passes
must add none), and the largest difference between the two backends' log-likelihoods is printed beside the rates.
On CPU the figures say what this machine does, not what an accelerator would. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jaxtrain.devices import use_simulated_devices  # noqa: E402

use_simulated_devices(8)  # before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from jaxtrain.evaluation.harness import JaxtrainLM  # noqa: E402
from jaxtrain.interop.exporting import export_hf  # noqa: E402
from jaxtrain.interop.importing import import_hf  # noqa: E402

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
WORDS = "apple bird cat dog egg fish goat hat ink jam kite lamp moon nest owl pig".split()


def llama_with_tokenizer(directory: Path, hidden: int = 64, layers: int = 2) -> None:
    """A random transformers Llama (float32, seeded) saved in `directory` with a byte-level BPE of 384 tokens that
    adds <s> before each text, as Llama's tokenizers do (<s> id 0, </s> id 1)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = np.random.default_rng(0)
    tokenizer.train_from_iterator([" ".join(rng.choice(WORDS, 6)) for _ in range(300)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(hf),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,  # logits spread over several nats: greedy choices are far from ties
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def choice_requests(count: int, seed: int = 0) -> list[Instance]:
    """`count` log-likelihood requests: a context of 8 to 40 words, a one-word continuation."""
    rng = np.random.default_rng(seed)
    requests = []
    for number in range(count):
        context = "Words: " + " ".join(rng.choice(WORDS, rng.integers(8, 41))) + "\nNext:"
        requests.append(Instance("loglikelihood", {}, (context, " " + rng.choice(WORDS)), number))
    return requests


class CompileCount:
    """Compiles of the scoring program (jax.monitoring; persistent-cache hits included)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, _seconds: float, **kwargs) -> None:
        self.count += event == BACKEND_COMPILE and kwargs.get("fun_name") == "jit(_score)"


def interleaved(backends: dict, requests: list[Instance], repeats: int, compiles: CompileCount) -> dict:
    """Each backend's log-likelihoods of a warm-up pass (and the scoring compiles there), then `repeats` rounds of one
    timed pass each, in turn (the machine's load falls on both alike); the median pass as requests/s, and the
    scoring compiles of the timed passes."""
    out = {}
    for name, lm in backends.items():
        before = compiles.count
        out[name] = {
            "results": lm.loglikelihood(requests, disable_tqdm=True),
            "compiles_warmup": compiles.count - before,
        }
    before, seconds = compiles.count, {name: [] for name in backends}
    for _ in range(repeats):
        for name, lm in backends.items():
            start = time.perf_counter()
            lm.loglikelihood(requests, disable_tqdm=True)
            seconds[name].append(time.perf_counter() - start)
    for name in backends:
        median = statistics.median(seconds[name])
        out[name] |= {"seconds_per_pass": round(median, 4), "requests_per_s": round(len(requests) / median, 1)}
    out["compiles_timed"] = compiles.count - before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per call, both backends")
    parser.add_argument("--mesh", default="data=8")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, help="PyTorch's CPU threads (default: its own choice)")
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    compiles = CompileCount()
    requests = choice_requests(args.requests)
    with tempfile.TemporaryDirectory(prefix="eval-bench-") as root:
        root = Path(root)
        llama_with_tokenizer(root / "hf", args.hidden, args.layers)
        import_hf(root / "hf", root / "import", dtype="float32", devices=jax.devices()[:1])
        export_hf(root / "import", root / "exported", devices=jax.devices()[:1])
        backends = {
            "jaxtrain": JaxtrainLM(path=str(root / "import"), mesh=args.mesh, batch_size=args.batch_size),
            "hf": HFLM(pretrained=str(root / "exported"), dtype="float32", device="cpu", batch_size=args.batch_size),
        }
        measured = interleaved(backends, requests, args.repeats, compiles)
    ours, theirs = measured["jaxtrain"].pop("results"), measured["hf"].pop("results")
    difference = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    measured["hf"].pop("compiles_warmup")
    report = {
        "requests": args.requests,
        "batch_size": args.batch_size,
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 384},
        "jaxtrain": {"mesh": args.mesh, "devices": len(jax.devices()), **measured["jaxtrain"]},
        "hf": {"torch_threads": torch.get_num_threads(), **measured["hf"]},
        "jaxtrain_over_hf": round(measured["jaxtrain"]["requests_per_s"] / measured["hf"]["requests_per_s"], 3),
        "scoring_compiles_timed": measured["compiles_timed"],
        "max_abs_log_likelihood_difference": float(f"{difference:.3g}"),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
