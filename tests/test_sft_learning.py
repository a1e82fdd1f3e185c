"""Supervised fine-tuning learns a task with checkable answers (slow: about 1.5 minutes on 2 CPU cores).

A tiny Llama (llama-tiny: d_model 64, 2 layers, 148k params) is pre-trained here for 1,000 steps on plain text of
three string transforms of random 4-letter words (`#Upper: abcd<|end|>\\n>ABCD<|end|>`, and Shift, Rot13), then
fine-tuned for 800 steps on the same transforms as chat conversations (`<|user|>Shift: wxyz<|end|>\\n<|assistant|>`
..., a role token where the text had '#' and '>'), the whole model and with LoRA (rank 8) from the same checkpoint.
No word is in two examples, so each of the 122 held-out prompts (every one `jaxtrain tokenize --val-fraction 0.06`
holds out of 2,000) is new; a reply scores by exact match of the greedy answer. scripts/instruction_task.py makes
the task, benchmarks/sft_learning.py the runs.

Measured (`python benchmarks/sft_learning.py --seeds 0 1 2`, docs/results/sft_learning.json), held-out exact match:

| seed | base model | whole model, step 200 / 800 | LoRA rank 8, step 200 / 800 |
| --- | --- | --- | --- |
| 0 | 0.000 | 0.902 / 1.000 | 0.795 / 1.000 |
| 1 | 0.000 | 1.000 / 1.000 | 1.000 / 1.000 |
| 2 | 0.000 | 1.000 / 1.000 | 1.000 / 1.000 |

This test (seed 0) measured base 0.000, whole model 1.000, LoRA 1.000, in 84-100 s on 2 cores. It asserts the
whole model >= 0.90, LoRA within 5 points of it, and the base below 0.05 (the chat format is what fine-tuning
teaches).
"""

import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_learning  # noqa: E402

pytestmark = pytest.mark.slow
DEVICES = 2


def test_full_and_lora_fine_tuning_reach_90_percent_exact_match(tmp_path):
    devices = jax.devices()[:DEVICES]
    paths = sft_learning.tokenize(tmp_path, seed=0)
    base = sft_learning.pretrain(paths, 0, devices)
    before = sft_learning.base_score(paths, base, 0, devices)
    scores = {}
    for run in sft_learning.RUNS:
        summary = sft_learning.finetune(paths, base, 0, run, devices, every=sft_learning.SFT_STEPS)
        scores[run] = summary["val_exact_match"]
    print(f"\nheld-out exact match: base {before:.3f}, whole model {scores['full']:.3f}, LoRA {scores['lora']:.3f}")
    assert before < 0.05, before
    assert scores["full"] >= 0.90, scores
    assert scores["lora"] >= scores["full"] - 0.05, scores
