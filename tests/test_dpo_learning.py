"""DPO learns to prefer the correct answer on pairs it never saw (slow: 1-1.5 minutes on 2 CPU cores).

The tiny Llama of tests/test_sft_learning.py, pre-trained for 1,000 steps on plain text of three string transforms of
random 4-letter words, is trained with DPO (beta 0.1, the whole model) for 150 steps on 1,872 chat-format pairs:
`<|user|>Shift: wxyz<|end|>\\n<|assistant|>` preferring the correct `xyza` to another transform of the word or the
word copied. The 128 held-out pairs are the file's last (`data.val_fraction`), their words in no other example.
benchmarks/dpo_learning.py makes the pairs and runs the longer version (300 steps, three seeds, LoRA and SimPO too).

DPO's held-out preference accuracy is 0 at step 0 by definition (the policy is the reference, both rewards 0); the
baseline is the base model's own preference, log π(chosen) > log π(rejected), on the same pairs. This test (seed 0)
measured the base's own held-out preference at 0.664 (0.524, chance, where the rejected reply is another transform),
and after 150 steps a held-out preference accuracy of 0.977 and the model's own preference 0.984 (0.976 against
another transform; 0.984 on the training pairs), in 61-88 s on 2 cores under a load of 1-4 from other work; at 100
steps 0.945 and 0.969. It asserts the accuracy and the own preference >= 0.90, and the base's own preference below
0.80 (what the base already knew is not what is measured).
"""

import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import dpo_learning  # noqa: E402
import sft_learning  # noqa: E402

pytestmark = pytest.mark.slow
DEVICES = 2
STEPS = 150


def test_dpo_reaches_90_percent_held_out_preference_accuracy(tmp_path):
    devices = jax.devices()[:DEVICES]
    paths = dpo_learning.write_pairs(tmp_path, seed=0)
    base = sft_learning.pretrain(paths, 0, devices)
    before = dpo_learning.base_preference(paths, base, 0, devices)
    result = dpo_learning.train(paths, base, 0, "dpo", devices, steps=STEPS, every=STEPS)
    accuracy, after = result["curve"][-1]["val_preference_accuracy"], result["own_preference"]
    print(f"\nheld-out: base's own preference {before}; after {STEPS} steps accuracy {accuracy:.3f}, own {after}")
    assert before["val"] < 0.80, before
    assert accuracy >= 0.90, result["curve"]
    assert after["val"] >= 0.90 and after["val"] > before["val"], after
