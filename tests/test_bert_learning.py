"""An encoder learns (slow: benchmarks/bert_learning.py, seed 0, on 2 simulated devices): MLM on tinyshakespeare's
bytes brings the held-out masked-byte loss well below the bytes' unigram entropy in 300 steps, and a classifier
fine-tuned from that checkpoint reaches 95% held-out accuracy on the built-in generated task. The measured figures
are in docs/results/bert_learning.json (and the plot beside it)."""

import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bert_learning  # noqa: E402
from conftest import shared_file  # noqa: E402

pytestmark = pytest.mark.slow


def test_mlm_beats_unigram_entropy_and_the_classifier_reaches_95_percent(tmp_path):
    text = shared_file("tinyshakespeare.txt")
    result = bert_learning.run(text, tmp_path, seed=0, devices=jax.devices()[: bert_learning.DEVICES])
    entropy, final_loss = result["mlm"]["unigram_entropy"], result["mlm"]["val_loss"][-1][1]
    accuracy = result["classifier"]["val_accuracy"][-1][1]
    print(f"\nunigram entropy {entropy:.3f}, val masked loss {final_loss:.3f}, held-out accuracy {accuracy:.3f}")
    assert final_loss < 0.75 * entropy, (final_loss, entropy)
    assert accuracy >= 0.95, result["classifier"]["val_accuracy"]
