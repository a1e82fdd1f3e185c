"""GRPO improves on its SFT starting point on prompts it never saw (slow: 2-3 minutes on 2 CPU cores).

The tiny Llama of tests/test_sft_learning.py, pre-trained for 1,000 steps on plain text of three string transforms of
random 4-letter words, is fine-tuned for 200 steps on chat conversations whose replies a noisy teacher wrote (half
of them the word under another transform), then trained with GRPO for STEPS steps on the same prompts, rewarded 1
for the exact correct answer. The 128 held-out prompts are in neither. benchmarks/grpo_learning.py runs the longer
version (1,000 steps, three seeds, and the control: as many more SFT steps on the teacher's replies).

Held-out greedy exact match, seed 0: 0.172 after SFT; after GRPO steps 200 / 400: 0.320 / 0.414 (GRPO 27 s, the
test 75 s, on 2 cores; the benchmark's 1,000 steps reach 0.578). It asserts GRPO's held-out score rises by at least
15 points in STEPS steps, and that the score at GRPO's step 0 is the SFT checkpoint's, computed apart.
"""

import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_learning  # noqa: E402
import sft_learning  # noqa: E402

pytestmark = pytest.mark.slow
DEVICES = 2
STEPS = 400


def test_grpo_raises_held_out_exact_match_after_sft(tmp_path):
    devices = jax.devices()[:DEVICES]
    paths = grpo_learning.write_task(tmp_path, seed=0)
    base = sft_learning.pretrain(paths, 0, devices)
    sft = grpo_learning.finetune(paths, base, 0, devices, grpo_learning.SFT_STEPS)
    apart = grpo_learning.held_out_exact_match(paths, sft, devices)
    result = grpo_learning.reinforce(paths, sft, 0, devices, steps=STEPS, every=STEPS // 2)
    scores = [(c["step"], c["val_exact_match"]) for c in result["curve"] if "val_exact_match" in c]
    print(f"\nheld-out exact match: SFT {apart:.3f}; GRPO {scores} in {result['seconds']} s")
    assert [step for step, _ in scores] == [0, STEPS // 2, STEPS]
    assert scores[0][1] == round(apart, 5)  # the curve keeps 5 decimals
    assert scores[-1][1] >= scores[0][1] + 0.15, scores
