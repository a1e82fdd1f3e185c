"""`python -m jaxtrain.evaluation ARGS`: lm-eval-harness's own command line (`lm-eval ARGS`, every option the same)
with the model `jaxtrain` registered, which lm-eval 0.4 has no plugin mechanism to find by itself:

    $ python -m jaxtrain.evaluation --model jaxtrain --model_args path=runs/x,mesh=data=2,tensor=2 \
          --tasks my_choice --include_path my_tasks --batch_size 16

Bad input of ours (a checkpoint that is not a language model, a mesh the devices do not fill) is one line and exit
status 2; lm-eval reports its own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxtrain.errors import UserInputError
from jaxtrain.evaluation.tasks import TaskError, lm_eval_installed

BAD_INPUT_EXIT = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run lm-eval's command line on `argv` (default: this process's arguments); the exit status."""
    try:
        lm_eval_installed()
    except TaskError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT_EXIT
    from lm_eval.__main__ import cli_evaluate

    import jaxtrain.evaluation.harness  # noqa: F401 - registers --model jaxtrain

    saved = sys.argv
    sys.argv = [saved[0], *(saved[1:] if argv is None else argv)]  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT_EXIT
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
