"""Write a SLURM batch script that runs one training job on a GPU cluster, one process per GPU, and submit it.

    python scripts/slurm_train.py --nodes 4 --gpus-per-node 8 --partition gpu --time 04:00:00 --dry-run -- \\
        --model gpt-1b --mesh gpu-4x8 --steps 1000 --checkpoint-dir runs/gpt-1b

The job runs `python scripts/train.py --coordinator <first node>:<port> --num-processes <tasks> --process-id <task>
<args after -->` in every task, from --repo-dir (default: this checkout, which the nodes must see on a shared file
system); paths in the training arguments are relative to it. sbatch passes the submitting shell's environment on, so
activate the environment that has jaxtrain installed before submitting. Without --dry-run the script is written to
--output and submitted with sbatch; --dry-run prints the script, then the sbatch command line, and writes nothing.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from jaxtrain.cli import flag_type  # noqa: E402  (imports no JAX)


def directive_value(text: str) -> str:
    """An #SBATCH value: sbatch splits directive lines at whitespace, so a value must have none."""
    if not text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"'{text}' must be non-empty and without spaces")
    return text


def directives(nodes: int, gpus_per_node: int, job_name: str, partition: str | None, time: str | None) -> list[str]:
    lines = [
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "# One process per GPU: under SLURM, JAX gives each process only the GPU numbered $SLURM_LOCALID (even with",
        "# explicit --coordinator flags), so one task per node would train on a single GPU of each node.",
        f"#SBATCH --ntasks-per-node={gpus_per_node}",
        "# Every task sees all of its node's GPUs: with --gpus-per-task=1 a task would see its GPU as number 0, not as",
        "# the $SLURM_LOCALID that JAX asks for.",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
    ]
    lines += [f"#SBATCH --partition={partition}"] if partition else []
    lines += [f"#SBATCH --time={time}"] if time else []
    return [*lines, "#SBATCH --output=%x-%j.out"]


def task_command(train_args: list[str], python: str = "python") -> str:
    """What each task runs, with the coordinator and the task's own id and count left for its shell to expand."""
    train = shlex.join([python, "scripts/train.py"])
    process = '--coordinator "$COORDINATOR" --num-processes "$SLURM_NTASKS" --process-id "$SLURM_PROCID"'
    # exec: the SIGTERM of a time limit or preemption reaches train.py, which saves a checkpoint before exiting.
    return f"exec {train} {process} {shlex.join(train_args)}".rstrip()


def sbatch_script(
    nodes: int,
    gpus_per_node: int,
    train_args: list[str],
    job_name: str = "jaxtrain",
    partition: str | None = None,
    time: str | None = None,
    port: int = 8476,
    repo_dir: str = str(ROOT),
    python: str = "python",
) -> str:
    """The batch script: #SBATCH directives, then srun starting one training process per GPU."""
    lines = [
        "#!/bin/bash",
        f"# Written by scripts/slurm_train.py: jaxtrain on {nodes} nodes x {gpus_per_node} GPUs.",
        *directives(nodes, gpus_per_node, job_name, partition, time),
        "set -eu",
        f"cd {shlex.quote(repo_dir)}",
        "# Process 0 (the coordinator every process contacts) runs on the job's first node.",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f'export COORDINATOR="$HEAD:{port}"',
        "# Explicit process settings work wherever srun does; where JAX's own SLURM detection is available,",
        "# train.py --auto-cluster instead of these three flags does the same. $SLURM_PROCID must be expanded in each",
        "# task's shell (here it is 0), hence bash -c. --kill-on-bad-exit: one failed process ends the whole step.",
        f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(task_command(train_args, python))}",
    ]
    return "\n".join(lines) + "\n"


def submit(script: str, path: Path) -> int:
    """Write the script to `path` and submit it; return sbatch's exit status."""
    path.write_text(script)
    if shutil.which("sbatch") is None:
        raise SystemExit(
            f"slurm_train: sbatch is not on PATH. Wrote {path}: submit it with `sbatch {path}` on the cluster's "
            "login node, or add --dry-run to print the script instead."
        )
    return subprocess.run(["sbatch", str(path)]).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=flag_type(at_least=1), required=True)
    parser.add_argument("--gpus-per-node", type=flag_type(at_least=1), required=True)
    parser.add_argument("--partition", type=directive_value)
    parser.add_argument("--time", type=directive_value, help="time limit, HH:MM:SS")
    parser.add_argument("--job-name", type=directive_value, default="jaxtrain")
    parser.add_argument(
        "--port",
        type=flag_type(at_least=1, at_most=65535),
        default=8476,
        help="the coordinator's port on the first node",
    )
    parser.add_argument("--repo-dir", default=str(ROOT), help="the checkout on the nodes (default: this one)")
    parser.add_argument("--python", default="python", help="interpreter on the nodes (default: python on PATH)")
    parser.add_argument("--output", type=Path, help="where to write the script (default: JOB_NAME.sbatch)")
    parser.add_argument("--dry-run", action="store_true", help="print the script and the sbatch command only")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then scripts/train.py's arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    script = sbatch_script(
        args.nodes,
        args.gpus_per_node,
        train_args,
        job_name=args.job_name,
        partition=args.partition,
        time=args.time,
        port=args.port,
        repo_dir=args.repo_dir,
        python=args.python,
    )
    path = args.output or Path(f"{args.job_name}.sbatch")
    if args.dry_run:
        print(script)
        print(shlex.join(["sbatch", str(path)]))
        return 0
    return submit(script, path)


if __name__ == "__main__":
    sys.exit(main())
