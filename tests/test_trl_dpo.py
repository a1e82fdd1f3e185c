"""Against a peer (issue 42): jaxtrain's DPO loss and its gradient equal TRL's `DPOTrainer` loss and gradient, to 1e-4
relative (float32; measured: about 1e-7 for the loss and the gradient norm, 1e-6 for each gradient tensor), on a
randomly initialised transformers Llama and one batch of preference pairs, nothing downloaded.

The models: test_trl_sft's random Llama (test_hf_interop's SIZES, the llama3 tokenizer and chat template, seed 0),
its vocabulary padded to 384 rows (the tokenizer's 381 tokens rounded up to jaxtrain's multiple of 128, so the mesh
check's tensor axis can split it), saved as the reference; the policy is the same weights plus N(0, 0.02²) noise, saved
beside it (otherwise policy = reference and every loss is ln 2). Both are imported with `jaxtrain import-hf --dtype
float32`; neither ties its embeddings.

TRL: `DPOTrainer(policy, ref_model=reference)`, loss_type ["sigmoid"], β = 0.1, `precompute_ref_log_probs=False`,
bf16=False, use_cpu=True, in eval mode (no dropout), one batch of all 8 pairs from `get_train_dataloader` (its sampler
shuffles them: the loss, a mean over pairs, and its gradient do not depend on the order; per-pair values are matched by
their token ids); the gradient is the model's after `compute_loss(...).backward()`. jaxtrain: the policy's import with
`data.source=pairs:FILE` and `data.tokenizer=` the reference import's `hf/` (its tokenizer, chat template and
tokenizer_config.json's eos_token), preference.loss=dpo, each pair's reference log-probs computed once from the
reference import's params (`attach_reference`), `compiled_grad` on `run.batch("train", 0)`. Compared:

- the tokens: each pair's two rows are TRL's prompt_ids + chosen_ids / rejected_ids, and the loss weights are 1 on
  exactly TRL's completion tokens;
- each pair's chosen and rejected log-probs, of the policy and of the reference, against TRL's fused head's summed as
  `_compute_loss` sums them; TRL's logps/chosen, logps/rejected, rewards/chosen and rewards/margins metrics;
- the loss, the global L2 norm of the gradient, and each gradient tensor (jaxtrain's laid out as `export-hf` lays out
  params, by Hugging Face name; the same set of tensors on both sides).

Two kinds of record: plain text (TRL appends the eos token's text, <|eot_id|>, to each reply; the last prompt ends
inside a word, so tokenizing prompt + reply merges across the boundary and the reply starts where the two tokenizations
diverge, on both sides) and conversations (a prompt of messages, replies of one assistant message, rendered with the
Llama 3 template).

SimPO against TRL's experimental `CPOTrainer(loss_type="simpo", cpo_alpha=0.0)`, β = 2, γ = 0.5: the loss, the
gradient norm and each pair's length-normalised log-probs, on the conversations only. CPOTrainer tokenizes plain text
its own (older) way, unlike DPOTrainer: the prompt alone, then at most one merged token moved into the reply, the BOS
token put first whenever the tokenizer has one, the eos token id appended; for conversations (rendered text starting
with BOS and replies ending in <|eot_id|>, the eos token) its ids are DPOTrainer's, and jaxtrain's.

The mesh: jaxtrain's DPO loss and gradients on data=2,fsdp=2,tensor=2 (8 simulated devices; reference log-probs
computed on that mesh) equal those on one device, within 1e-6 (loss) and 1e-5 (each gradient entry, relative to the
tensor's largest).

Tokenization checked beside the losses: plain text with a tokenizer whose post-processor adds a BOS token (Llama 3's,
Gemma's, Mistral's) starts each prompt with BOS on both sides (TRL's `_tokenize` calls the tokenizer; jaxtrain encodes
plain text with the tokenizer's own added tokens); and the text appended to plain replies is tokenizer_config.json's
eos_token on both sides (<|eot_id|> here, not the first end-of-text name the vocabulary holds).
"""

import functools
import json
import warnings

import jax
import numpy as np
import optax
import pytest
from test_chat_data import SYSTEM, sentence
from test_hf_interop import SIZES
from test_trl_sft import FAMILIES, ROW, RTOL, assert_close, bpe, run_cli
from tokenizers import Tokenizer, processors

from jaxtrain.data.pairs import PAIR_KEYS
from jaxtrain.data.tokenizer import padded_vocab
from jaxtrain.interop.architectures import architecture_for
from jaxtrain.interop.exporting import pending_tensor
from jaxtrain.posttrain.preference import sequence_log_probs
from jaxtrain.run_config import load_config
from jaxtrain.training.checkpoint import restore_params
from jaxtrain.training.reference import attach_reference
from jaxtrain.training.setup import build, preference_pairs

torch = pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
datasets = pytest.importorskip("datasets", reason="comparing with TRL needs trl and datasets: pip install trl")
trl = pytest.importorskip("trl", reason="comparing with TRL needs trl: pip install trl")

PAIRS = 8  # one batch of all of them, on both sides
BETA = 0.1
NOISE = 0.02  # the policy: the reference's weights plus this much Gaussian noise
SIMPO_BETA, GAMMA = 2.0, 0.5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dpo")


@functools.cache
def model_directories(root) -> tuple:
    """(reference, policy): test_trl_sft's random float32 Llama with its llama3 tokenizer and chat template, but with
    the vocabulary padded to jaxtrain's multiple of 128 (381 tokens, 384 rows: the tensor axis splits it, as a real
    model's), saved and imported (`jaxtrain import-hf --dtype float32`); and the same weights plus NOISE, saved and
    imported beside it."""
    template, special = FAMILIES["llama3"]
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe(), chat_template=template, **special)
    config = transformers.LlamaConfig(**{**SIZES, "vocab_size": padded_vocab(len(tokenizer))}, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directories = root / "reference", root / "policy"
    for directory in directories:
        tokenizer.save_pretrained(directory)
        model.save_pretrained(directory)
        run_cli(["import-hf", str(directory), str(directory / "import"), "--dtype", "float32"])
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(NOISE * torch.randn(p.shape, generator=generator))
    return directories


def plain_pairs(seed: int = 0) -> list[dict]:
    """Plain-text pairs; the last prompt ends inside a word, so its reply's first token merges across the boundary."""
    rng = np.random.default_rng(seed)
    records = [
        {
            "prompt": sentence(rng, 2, 8)[:-1] + "?",
            "chosen": " " + sentence(rng, 1, 10),
            "rejected": sentence(rng, 1, 10),
        }
        for _ in range(PAIRS - 1)
    ]
    return [*records, {"prompt": "What is the capi", "chosen": "tal of france? Paris.", "rejected": "tal? Eight."}]


def conversation_pairs(seed: int = 1) -> list[dict]:
    """Conversational pairs (TRL's format): prompts of 1 or 2 user turns, half with a system message."""
    rng = np.random.default_rng(seed)
    records = []
    for k in range(PAIRS):
        prompt = [SYSTEM] if k % 2 else []
        for turn in range(rng.integers(1, 3)):
            if turn:
                prompt += [{"role": "assistant", "content": sentence(rng, 1, 6)}]
            prompt += [{"role": "user", "content": sentence(rng, 2, 7)[:-1] + "?"}]
        replies = [[{"role": "assistant", "content": sentence(rng, 1, 10)}] for _ in range(2)]
        records.append({"prompt": prompt, "chosen": replies[0], "rejected": replies[1]})
    return records


RECORDS = {"plain": plain_pairs, "conversation": conversation_pairs}


def write_records(root, name: str, records: list[dict]):
    path = root / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trl_dpo(root, kind: str, records: list[dict]) -> dict:
    """TRL's DPOTrainer on the policy, with the unperturbed model as its `ref_model`: its tokenized pairs (in record
    order, and the length of each prompt tokenized alone), the loss of its one batch of all `records` (eval mode),
    the global gradient norm after `backward`, its metrics, and each pair's policy and reference log-probs by TRL's
    own fused head (keyed by the pair's prompt + chosen ids)."""
    reference, policy = model_directories(root)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reference)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with warnings.catch_warnings():  # TRL's own defaults warn; nothing trains
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(
            output_dir=str(root / f"trl-{kind}"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=len(records),
            max_length=ROW,
            beta=BETA,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=False,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = trl.DPOTrainer(
            model,
            ref_model=ref_model,
            args=args,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=tokenizer,
        )
    columns = trainer.train_dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"])
    tokenized = [(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in columns]
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1
    batch = batches[0]
    model.eval()
    ref_model.eval()
    with warnings.catch_warnings():  # a deprecation inside TRL
        warnings.simplefilter("ignore")
        loss = trainer.compute_loss(model, {k: v.clone() for k, v in batch.items()})
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    # Each pair's log-probs as `_compute_loss` takes them: the fused head's, summed over the reply's tokens.
    ids, mask = batch["input_ids"], batch["attention_mask"]
    fused = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(batch["completion_mask"] == 0, -100)}
    with torch.no_grad():
        policy_logps = model(**fused, fused_lm_head=True).log_probs.sum(1).view(2, -1).T.tolist()
        reference_logps = ref_model(**fused, fused_lm_head=True).log_probs.sum(1).view(2, -1).T.tolist()
    keys = [tuple(ids[i, : int(mask[i].sum())].tolist()) for i in range(len(records))]  # the chosen rows
    prompts = [r["prompt"] for r in records]
    return {
        "tokenized": tokenized,
        "prompt_lengths": [len(tokenizer(p)["input_ids"]) if isinstance(p, str) else None for p in prompts],
        "eos_id": tokenizer.eos_token_id,
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "grads": grads,
        "metrics": {k: v[-1] for k, v in trainer._metrics["eval"].items()},
        "policy": dict(zip(keys, policy_logps)),
        "reference": dict(zip(keys, reference_logps)),
    }


@functools.cache
def jaxtrain_preference(root, kind: str, loss: str = "dpo", mesh: str = "data=1") -> dict:
    """The policy's import as a `loss` run (dpo: against the unperturbed import, whose params compute every pair's
    reference log-probs; simpo: no reference) on the pairs of `kind` (`data.source=pairs:FILE`, with the reference's
    tokenizer and chat template): the loss, metrics and gradients of its first batch (all the pairs, in an order of
    the run's), and each pair's tokens, weights and log-probs in the file's order."""
    reference, policy = model_directories(root)
    path = write_records(root, kind, RECORDS[kind]())
    options = (
        [f"preference.beta={BETA}"] if loss == "dpo" else [f"preference.beta={SIMPO_BETA}", f"preference.gamma={GAMMA}"]
    )
    cfg = load_config(
        policy / "import" / "config.toml",
        overrides=[
            f"checkpoint.restore={policy / 'import'}",
            f"data.source=pairs:{path}",
            f"data.tokenizer={reference / 'import' / 'hf'}",
            "data.val_fraction=0.01",  # rounds to no pair held out: the one batch holds every pair
            f"mesh={mesh}",
            f"batch_size={PAIRS}",
            f"seq_len={ROW - 1}",
            "train.progress=false",
            f"preference.loss={loss}",
            *options,
        ],
    )
    assert not cfg.model.tie_embeddings  # as the transformers model: its lm_head is a weight of its own
    run = build(cfg, log=lambda *_: None, devices=jax.devices()[:1] if mesh == "data=1" else jax.devices())
    abstract = run.shardings.abstract_state["params"]
    params, _ = restore_params(cfg.checkpoint.restore, abstract)
    if loss == "dpo":
        reference_params, _ = restore_params(reference / "import", abstract)
        attach_reference(run, reference_params, log=lambda *_: None)
    batch = run.batch("train", 0)
    (loss_value, metrics), grads = run.compiled_grad(params, batch)
    tokens, weights = run.dataset.splits["train"]
    assert len(tokens) == PAIRS
    module = run.shardings.model.module
    log_probs = jax.jit(lambda p, b: sequence_log_probs(module(p).target_log_probs, b))
    return {
        "loss": float(loss_value),
        "eval_loss": float(run.compiled_eval(params, batch)["loss"]),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "grads": jax.tree.map(np.asarray, grads),
        "grad_norm": float(optax.tree.norm(grads)),
        "hf_grads": hf_layout(cfg.model, grads),
        "tokens": tokens,
        "weights": weights,
        "policy": np.asarray(log_probs(params, {PAIR_KEYS[0]: tokens, PAIR_KEYS[1]: weights})),
        "reference": run.dataset.reference["train"] if loss == "dpo" else None,
    }


def hf_layout(model, grads) -> dict[str, np.ndarray]:
    """jaxtrain's gradients as the transformers model's named tensors, as `jaxtrain export-hf` lays out params."""
    tensors = architecture_for(model).table(model.tie_embeddings)
    layers = [range(model.n_layers) if tensor.stacked else [None] for tensor in tensors]
    pending = [pending_tensor(t, grads, layer, np.dtype(np.float32)) for t, ls in zip(tensors, layers) for layer in ls]
    return {p.name: p.produce() for p in pending}


def difference(ours, theirs) -> float:
    """|ours - theirs| / |theirs|, Frobenius norms."""
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))


def assert_same_pairs(ours: dict, tokenized: list[tuple[list[int], list[int], list[int]]]) -> None:
    """jaxtrain's rows of each pair are TRL's prompt + reply ids, its weights 1 on TRL's reply ids only."""
    for i, (prompt, chosen, rejected) in enumerate(tokenized):
        for side, reply in enumerate((chosen, rejected)):
            n = len(prompt) + len(reply)
            assert ours["tokens"][i, side, :n].tolist() == prompt + reply, f"pair {i} side {side}: other token ids"
            assert ours["weights"][i, side].tolist() == [0] * len(prompt) + [1] * len(reply) + [0] * (ROW - n)


@pytest.mark.parametrize("kind", list(RECORDS))
def test_dpo_loss_and_gradient_equal_trl(root, kind):
    """The same tokens, the same per-pair log-probs (policy and reference), the same loss and gradient norm."""
    theirs = trl_dpo(root, kind, RECORDS[kind]())
    ours = jaxtrain_preference(root, kind)
    assert_same_pairs(ours, theirs["tokenized"])
    eos = theirs["eos_id"]
    assert all(reply[-1] == eos for _, *replies in theirs["tokenized"] for reply in replies)
    if kind == "plain":  # the last prompt's last token merges with its replies' first: the reply starts before it
        prompt, chosen, _ = theirs["tokenized"][-1]
        assert len(prompt) < theirs["prompt_lengths"][-1]
    keys = [tuple(prompt + chosen) for prompt, chosen, _ in theirs["tokenized"]]
    policy = relative(ours["policy"], [theirs["policy"][k] for k in keys])
    reference = relative(ours["reference"], [theirs["reference"][k] for k in keys])
    assert max(policy, reference) <= RTOL
    for ours_key, trl_key in [("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected")]:
        assert_close(ours["metrics"][ours_key], theirs["metrics"][trl_key])
    for ours_key, trl_key in [("rewards_chosen", "rewards/chosen"), ("reward_margin", "rewards/margins")]:
        assert abs(ours["metrics"][ours_key] - theirs["metrics"][trl_key]) <= 1e-5
    # Tensor by tensor in the Hugging Face layout (the import's table read backwards): the same tensors, so the
    # norms are over the same entries, and each equal.
    assert sorted(ours["hf_grads"]) == sorted(theirs["grads"])
    tensors = max(difference(ours["hf_grads"][k], theirs["grads"][k]) for k in theirs["grads"])
    assert tensors <= RTOL
    assert ours["eval_loss"] == ours["loss"]
    assert abs(theirs["loss"] - np.log(2)) > 1e-2  # the policy is not the reference
    loss = assert_close(ours["loss"], theirs["loss"])
    norm = assert_close(ours["grad_norm"], theirs["grad_norm"])
    print(
        f"\n{kind} DPO: loss {ours['loss']:.6f} (relative difference to TRL {loss:.2g}), gradient norm "
        f"{ours['grad_norm']:.6f} ({norm:.2g}), each gradient tensor {tensors:.2g}, per-pair log-probs: policy "
        f"{policy:.2g}, reference {reference:.2g}"
    )


def trl_simpo(root, records: list[dict]) -> dict:
    """TRL's SimPO (the experimental `CPOTrainer` with loss_type="simpo", cpo_alpha=0) on the policy: its tokenized
    pairs in record order, the loss of its one batch of all `records` (eval mode) and the gradient norm, and each
    pair's length-normalised log-probs (keyed by the pair's prompt + chosen ids)."""
    with warnings.catch_warnings():  # that it is experimental
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig, CPOTrainer

    reference, policy = model_directories(root)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reference)
    tokenizer.pad_token = tokenizer.eos_token  # the CPOTrainer's collator pads with it (its labels: -100)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    with warnings.catch_warnings():  # experimental, and TRL's own defaults warn; nothing trains
        warnings.simplefilter("ignore")
        args = CPOConfig(
            output_dir=str(root / "trl-simpo"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=len(records),
            max_length=ROW,
            loss_type="simpo",
            cpo_alpha=0.0,
            beta=SIMPO_BETA,
            simpo_gamma=GAMMA,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = CPOTrainer(
            model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer
        )
    tokenized = []
    for row in trainer.train_dataset:
        prompt = row["prompt_input_ids"]
        replies = [row[f"{side}_input_ids"] for side in ("chosen", "rejected")]
        assert all(reply[: len(prompt)] == prompt for reply in replies)
        tokenized.append((prompt, *(reply[len(prompt) :] for reply in replies)))
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 1
    batch = batches[0]
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = trainer.compute_loss(model, batch)
    loss.backward()
    grad_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    with torch.no_grad():
        chosen, rejected = trainer.concatenated_forward(model, batch)[:2]
    mask = batch["chosen_attention_mask"]
    keys = [tuple(batch["chosen_input_ids"][i, : int(mask[i].sum())].tolist()) for i in range(len(records))]
    return {
        "tokenized": tokenized,
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "normalised": dict(zip(keys, torch.stack([chosen, rejected], 1).tolist())),
    }


def test_simpo_loss_and_gradient_equal_trl_cpo(root):
    """SimPO: -log σ(β (ℓ_chosen - ℓ_rejected) - γ), ℓ a reply's mean token log-prob, against TRL's CPOTrainer (which
    tokenizes conversations by their rendered text: the same ids here)."""
    records = conversation_pairs()
    theirs = trl_simpo(root, records)
    ours = jaxtrain_preference(root, "conversation", "simpo")
    assert_same_pairs(ours, theirs["tokenized"])
    keys = [tuple(prompt + chosen) for prompt, chosen, _ in theirs["tokenized"]]
    normalised = ours["policy"] / ours["weights"][..., 1:].sum(-1)
    pairs = relative(normalised, [theirs["normalised"][k] for k in keys])
    assert pairs <= RTOL
    loss = assert_close(ours["loss"], theirs["loss"])
    norm = assert_close(ours["grad_norm"], theirs["grad_norm"])
    print(
        f"\nconversation SimPO: loss {ours['loss']:.6f} (relative difference to TRL {loss:.2g}), gradient norm "
        f"{ours['grad_norm']:.6f} ({norm:.2g}), per-pair mean log-probs {pairs:.2g}"
    )


def test_dpo_on_a_mesh_equals_one_device(root):
    """jaxtrain's DPO loss and gradients on data=2,fsdp=2,tensor=2 (reference log-probs computed on that mesh too)
    equal those on one device."""
    one = jaxtrain_preference(root, "conversation")
    mesh = jaxtrain_preference(root, "conversation", mesh="data=2,fsdp=2,tensor=2")
    np.testing.assert_allclose(mesh["reference"], one["reference"], rtol=1e-6)
    assert abs(mesh["loss"] / one["loss"] - 1) <= 1e-6
    leaves = [jax.tree_util.tree_leaves_with_path(run["grads"]) for run in (mesh, one)]
    worst = 0.0
    for (path, ours), (same_path, single) in zip(*leaves, strict=True):
        assert path == same_path
        scale = np.abs(single).max()
        np.testing.assert_allclose(ours, single, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
        worst = max(worst, float(np.abs(ours - single).max() / scale))
    print(
        f"\nDPO on data=2,fsdp=2,tensor=2: loss {abs(mesh['loss'] / one['loss'] - 1):.2g} relative to one device, "
        f"gradients {worst:.2g} (largest difference / the leaf's largest entry)"
    )


def test_plain_text_pairs_with_a_tokenizer_that_adds_bos(root):
    """The same plain-text pairs with a tokenizer whose post-processor adds <|begin_of_text|> (as Llama 3's does):
    TRL's prompt ids start with it, and so do jaxtrain's (it encodes plain text with the tokenizer's own added
    tokens, as transformers' `tokenizer(text)` does)."""
    reference, _ = model_directories(root)
    directory = root / "bos"
    tokenizer = Tokenizer.from_str(bpe().to_str())  # a copy: the cached one stays as test_trl_sft uses it
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    template, special = FAMILIES["llama3"]
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **special).save_pretrained(
        directory
    )
    records = plain_pairs()
    path = write_records(root, "bos", records)
    models = [transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.DPOConfig(output_dir=str(root / "trl-bos"), report_to=[], use_cpu=True, bf16=False)
        trainer = trl.DPOTrainer(
            models[0],
            ref_model=models[1],
            args=args,
            train_dataset=datasets.Dataset.from_list(records),
            processing_class=transformers.AutoTokenizer.from_pretrained(directory),
        )
    tokenized = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    assert all(prompt[0] == bos for prompt, _, _ in tokenized)  # TRL's prompts start with BOS
    cfg = load_config(
        reference / "import" / "config.toml",
        overrides=[
            f"data.source=pairs:{path}",
            f"data.tokenizer={directory}",
            "data.val_fraction=0.01",
            f"seq_len={ROW - 1}",
        ],
    )
    tokens, weights = preference_pairs(cfg).splits["train"]
    assert_same_pairs({"tokens": tokens, "weights": weights}, tokenized)
