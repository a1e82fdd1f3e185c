"""Run one training job on every worker of a Cloud TPU pod slice, over `gcloud compute tpus tpu-vm ssh --worker=all`.

    python scripts/launch_tpu.py --tpu my-v5p-128 --zone us-east5-a --setup --dry-run -- \\
        --model gpt-1b --mesh tpu-v5p-128 --steps 1000

Every worker runs the same command, `python3 scripts/train.py --auto-cluster <args after -->`, in the checkout at
--repo-dir on the VMs: on TPU VMs JAX finds the coordinator, the process count and each worker's id itself.
--setup first copies this checkout's code there and installs it with JAX's TPU runtime on every worker. Paths in the
training arguments are read on the VMs, relative to --repo-dir; a --checkpoint-dir must be one that every worker
shares (a mounted file share), since each writes its own part of a checkpoint. --dry-run prints each gcloud command,
shell-ready, one per line, and runs nothing.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the VMs need to install and run the trainer; not .git, .venv or runs/, which can be large.
SHIPPED = ("pyproject.toml", "README.md", "jaxtrain", "models", "scripts", "meshes")


def remote_path(path: str) -> str:
    """`path` quoted for the VMs' shell, a leading `~/` left unquoted so that it still means the home directory."""
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def train_command(repo_dir: str, train_args: list[str], python: str = "python3") -> str:
    """The shell command each worker runs: scripts/train.py in the checkout, the pod detected by JAX."""
    train = [python, "scripts/train.py", "--auto-cluster", *train_args]
    return f"cd {remote_path(repo_dir)} && {shlex.join(train)}"


def gcloud(verb: str, zone: str, project: str | None, *args: str) -> list[str]:
    """A `gcloud compute tpus tpu-vm` command addressed to every worker of the slice."""
    where = ["--zone", zone, *(["--project", project] if project else [])]
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, *args, *where, "--worker=all"]


def ssh(tpu: str, zone: str, project: str | None, command: str) -> list[str]:
    """The gcloud command that runs the shell `command` on every worker at once."""
    return [*gcloud("ssh", zone, project, tpu), "--command", command]


def setup_commands(tpu: str, zone: str, project: str | None, repo_dir: str, python: str = "python3") -> list[list[str]]:
    """Copy the code to `repo_dir` on every worker and install it there."""
    # scp copies several sources into a directory only if it exists; a home-relative destination (no `~`) is read
    # the same way by scp's old and new (SFTP) protocols.
    destination = repo_dir[2:] if repo_dir.startswith("~/") else repo_dir
    sources = [str(ROOT / name) for name in SHIPPED]
    # jaxtrain's own requirements give JAX without the TPU runtime (libtpu), with which it would train on the CPUs.
    install = f"cd {remote_path(repo_dir)} && {shlex.quote(python)} -m pip install -e . 'jax[tpu]'"
    return [
        ssh(tpu, zone, project, f"mkdir -p {remote_path(repo_dir)}"),
        gcloud("scp", zone, project, "--recurse", *sources, f"{tpu}:{destination}"),
        ssh(tpu, zone, project, install),
    ]


def commands(
    tpu: str,
    zone: str,
    project: str | None,
    repo_dir: str,
    train_args: list[str],
    setup: bool = False,
    python: str = "python3",
) -> list[list[str]]:
    """Every gcloud command of the launch, in order: the optional setup, then training."""
    steps = setup_commands(tpu, zone, project, repo_dir, python) if setup else []
    return [*steps, ssh(tpu, zone, project, train_command(repo_dir, train_args, python))]


def run(cmds: list[list[str]]) -> int:
    """Run the commands one after another; stop at the first failure and return its exit status."""
    if shutil.which("gcloud") is None:
        raise SystemExit(
            "launch_tpu: gcloud is not on PATH. Install the Google Cloud CLI "
            "(https://cloud.google.com/sdk/docs/install), or add --dry-run to print the commands instead."
        )
    for cmd in cmds:
        print(f"+ {shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            subprocess.run(cmd, check=True)
        except subprocess.CalledProcessError as err:
            print(f"launch_tpu: exit status {err.returncode} from: {shlex.join(cmd)}", file=sys.stderr)
            return err.returncode
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tpu", required=True, help="the TPU VM (pod slice) name")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--project", help="Google Cloud project (default: gcloud's configured one)")
    parser.add_argument("--repo-dir", default="~/jaxtrain", help="the checkout on the VMs (default ~/jaxtrain)")
    parser.add_argument("--python", default="python3", help="interpreter on the VMs (default python3)")
    parser.add_argument("--setup", action="store_true", help="first copy this checkout to the VMs and install it")
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then scripts/train.py's arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    cmds = commands(args.tpu, args.zone, args.project, args.repo_dir, train_args, args.setup, args.python)
    if args.dry_run:
        print("\n".join(shlex.join(cmd) for cmd in cmds))
        return 0
    return run(cmds)


if __name__ == "__main__":
    sys.exit(main())
