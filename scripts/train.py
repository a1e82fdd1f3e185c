"""Train a model on a device mesh: the same code as the `jaxtrain train` command.

    python scripts/train.py --simulated-devices 8                       # default GPT, built-in data, data=8
    python scripts/train.py --simulated-devices 8 --mesh data=2,fsdp=2,tensor=2 --model gpt-tiny --steps 200
    python scripts/train.py --simulated-devices 8 --model mlp --mesh data=8 --data ../shared/data/digits.csv.gz
    python scripts/train.py --help                                      # flags; --help-config lists key=value keys

The step is composed in jaxtrain/training/setup.py; the loop reads top to bottom in jaxtrain/training/loop.py.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
if (ROOT.parent / "shared" / "data").is_dir():  # `--data digits` names a file there
    os.environ.setdefault("JAXTRAIN_DATA_DIR", str(ROOT.parent / "shared" / "data"))

from jaxtrain.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
