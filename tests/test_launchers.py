"""The pod and cluster launchers: their dry runs print well-formed commands (a v5p-128 pod; 4 nodes x 8 GPUs) that
carry every training argument intact, and without --dry-run they run exactly those, or say clearly that gcloud or
sbatch is missing. Stand-ins for gcloud, srun and scontrol on PATH play the cluster."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from launch_tpu import remote_path, train_command  # noqa: E402
from slurm_train import sbatch_script  # noqa: E402

# Spaces, quotes and a `$` that no shell on the way may expand.
ARGS = ["--model", "gpt-1b", "--steps", "1000", "--data", "/data/my corpus.txt", 'note=it\'s "quoted" $HOME']
TPU = ["--tpu", "my-v5p-128", "--zone", "us-east5-a", "--project", "my-project"]
CLUSTER = ["--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "04:00:00", "--job-name", "gpt1b"]


def launcher(script: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path} if path is not None else None
    command = [sys.executable, str(ROOT / "scripts" / script), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=30)


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def argv_recorder(path: Path, log: Path, fail_on: str = "") -> Path:
    """A stand-in command that appends its arguments to `log` as one JSON line (and fails when given `fail_on`)."""
    code = f"import json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    code += f"sys.exit(3 if {fail_on!r} in sys.argv[1:] else 0)\n"
    return executable(path, f"#!{sys.executable}\n{code}")


def fake_checkout(directory: Path) -> Path:
    """A checkout whose scripts/train.py prints its arguments as JSON instead of training."""
    (directory / "scripts").mkdir(parents=True)
    (directory / "scripts" / "train.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    return directory


def test_tpu_dry_run_prints_one_gcloud_ssh_to_every_worker() -> None:
    result = launcher("launch_tpu.py", *TPU, "--dry-run", "--", *ARGS)
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    tokens = shlex.split(line)
    assert tokens[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-128"]
    assert "--worker=all" in tokens
    assert tokens[tokens.index("--zone") + 1] == "us-east5-a"
    assert tokens[tokens.index("--project") + 1] == "my-project"
    remote = shlex.split(tokens[tokens.index("--command") + 1])
    assert remote == ["cd", "~/jaxtrain", "&&", "python3", "scripts/train.py", "--auto-cluster", *ARGS]


def test_tpu_remote_command_survives_the_workers_shell(tmp_path: Path) -> None:
    checkout = fake_checkout(tmp_path / "my checkout")
    home = {**os.environ, "HOME": str(tmp_path)}
    for repo_dir in (str(checkout), "~/my checkout"):
        command = train_command(repo_dir, ARGS, sys.executable)
        ran = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=home, timeout=30)
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout) == ["--auto-cluster", *ARGS]
    assert remote_path("~/it's") == "~/'it'\"'\"'s'"


def test_tpu_setup_copies_the_code_and_installs_it_before_training() -> None:
    result = launcher("launch_tpu.py", *TPU, "--setup", "--repo-dir", "~/jt", "--dry-run", "--", *ARGS)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()]
    assert [c[4] for c in commands] == ["ssh", "scp", "ssh", "ssh"]
    assert all("--worker=all" in c for c in commands)
    mkdir, copy, install, train = (c[c.index("--command") + 1] if "--command" in c else c for c in commands)
    assert mkdir == "mkdir -p ~/jt"
    sources = copy[copy.index("--recurse") + 1 : copy.index("--zone") - 1]
    assert {Path(s).name for s in sources} >= {"pyproject.toml", "jaxtrain", "scripts", "meshes"}
    assert all(Path(s).exists() for s in sources) and copy[copy.index("--zone") - 1] == "my-v5p-128:jt"
    assert install == "cd ~/jt && python3 -m pip install -e . 'jax[tpu]'"
    assert "scripts/train.py --auto-cluster" in train


def test_tpu_runs_the_dry_run_commands_and_stops_at_a_failure(tmp_path: Path) -> None:
    log = tmp_path / "gcloud.log"
    argv_recorder(tmp_path / "gcloud", log)
    printed = launcher("launch_tpu.py", *TPU, "--setup", "--dry-run", "--", *ARGS).stdout.splitlines()
    result = launcher("launch_tpu.py", *TPU, "--setup", "--", *ARGS, path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in log.read_text().splitlines()] == [shlex.split(p)[1:] for p in printed]

    log.unlink()
    argv_recorder(tmp_path / "gcloud", log, fail_on="scp")
    result = launcher("launch_tpu.py", *TPU, "--setup", "--", *ARGS, path=str(tmp_path))
    assert result.returncode == 3 and "exit status 3 from: gcloud compute tpus tpu-vm scp" in result.stderr
    assert len(log.read_text().splitlines()) == 2  # mkdir, then the failed copy; no install, no training


def test_tpu_without_gcloud_says_so(tmp_path: Path) -> None:
    result = launcher("launch_tpu.py", *TPU, "--", *ARGS, path=str(tmp_path))
    assert result.returncode == 1
    assert "gcloud is not on PATH" in result.stderr and "Traceback" not in result.stderr


def split_dry_run(stdout: str) -> tuple[str, list[str]]:
    """The script and the sbatch command that a --dry-run printed."""
    script, _, command = stdout.rstrip("\n").rpartition("\n\n")
    return script + "\n", shlex.split(command)


def test_slurm_dry_run_prints_a_wellformed_batch_script(tmp_path: Path) -> None:
    result = launcher("slurm_train.py", *CLUSTER, "--dry-run", "--", *ARGS)
    assert result.returncode == 0, result.stderr
    script, command = split_dry_run(result.stdout)
    assert command == ["sbatch", "gpt1b.sbatch"]
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]  # sbatch reads only these
    directives = dict(line.removeprefix("#SBATCH ").split("=", 1) for line in header if line.startswith("#SBATCH "))
    assert directives == {
        "--job-name": "gpt1b",
        "--nodes": "4",
        "--ntasks-per-node": "8",
        "--gpus-per-node": "8",
        "--partition": "gpu",
        "--time": "04:00:00",
        "--output": "%x-%j.out",
    }
    assert 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    [srun] = [shlex.split(line) for line in lines if line.startswith("srun ")]
    assert srun[:4] == ["srun", "--kill-on-bad-exit=1", "bash", "-c"] and len(srun) == 5
    task = shlex.split(srun[4])
    assert task[:3] == ["exec", "python", "scripts/train.py"] and task[-len(ARGS) :] == ARGS
    process = dict(zip(task[3:9:2], task[4:9:2]))
    assert process == {
        "--coordinator": "$COORDINATOR",
        "--num-processes": "$SLURM_NTASKS",
        "--process-id": "$SLURM_PROCID",
    }
    (tmp_path / "job.sbatch").write_text(script)
    syntax = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_slurm_script_starts_one_process_per_gpu_with_its_own_id(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "scontrol", "#!/bin/bash\nprintf 'gpu-node-07\\ngpu-node-08\\n'\n")
    # srun's part: run the step's command once per task, each task with its own SLURM_PROCID.
    srun = '#!/bin/bash\nshift\nfor ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" || exit; done\n'
    executable(bin_dir / "srun", srun)
    checkout = fake_checkout(tmp_path / "my checkout")
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch_script(2, 2, ARGS, port=9000, repo_dir=str(checkout), python=sys.executable))
    # As in a batch job: the batch shell itself is task 0 of the allocation.
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-node-[07-08]"}
    env |= {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert ran.returncode == 0, ran.stderr
    coordinator = ["--coordinator", "gpu-node-07:9000", "--num-processes", "4"]
    assert [json.loads(line) for line in ran.stdout.splitlines()] == [
        [*coordinator, "--process-id", str(i), *ARGS] for i in range(4)
    ]


def test_slurm_writes_and_submits_the_script(tmp_path: Path) -> None:
    log = tmp_path / "sbatch.log"
    argv_recorder(tmp_path / "sbatch", log)
    job = tmp_path / "job.sbatch"
    printed, _ = split_dry_run(launcher("slurm_train.py", *CLUSTER, "--dry-run", "--", *ARGS).stdout)
    result = launcher("slurm_train.py", *CLUSTER, "--output", str(job), "--", *ARGS, path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert job.read_text() == printed and json.loads(log.read_text()) == [str(job)]


def test_slurm_without_sbatch_says_so_and_keeps_the_script(tmp_path: Path) -> None:
    job = tmp_path / "job.sbatch"
    result = launcher("slurm_train.py", *CLUSTER, "--output", str(job), "--", *ARGS, path=str(tmp_path))
    assert result.returncode == 1
    assert "sbatch is not on PATH" in result.stderr and "Traceback" not in result.stderr
    assert job.read_text().startswith("#!/bin/bash\n")


@pytest.mark.parametrize("flag", ["--job-name", "--partition", "--time"])
def test_slurm_refuses_directive_values_with_spaces(flag: str) -> None:
    result = launcher("slurm_train.py", "--nodes", "1", "--gpus-per-node", "8", flag, "a b", "--dry-run")
    assert result.returncode == 2 and "without spaces" in result.stderr


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("slurm_train.py", ["--nodes", "0", "--gpus-per-node", "8"], "--nodes: expected an integer >= 1, got '0'"),
        ("slurm_train.py", ["--nodes", "2", "--gpus-per-node", "-1"], "--gpus-per-node: expected an integer >= 1"),
        ("slurm_train.py", [*CLUSTER, "--port", "99999"], "--port: expected an integer >= 1 and <= 65535, got '99999'"),
        (
            "launch_local.py",
            ["--processes", "0", "--devices-per-process", "4"],
            "--processes: expected an integer >= 1",
        ),
        ("launch_local.py", ["--processes", "2", "--devices-per-process", "0"], "--devices-per-process: expected an"),
        ("launch_local.py", ["--processes", "2", "--devices-per-process", "4", "--grace", "nan"], "expected a finite"),
        (
            "launch_local.py",
            ["--processes", "2", "--devices-per-process", "4", "--max-restarts", "2"],
            "name no --checkpoint-dir",
        ),
        ("launch_local.py", ["--processes", "2", "--devices-per-process", "4", "--elastic"], "give --max-restarts"),
    ],
)
def test_launchers_refuse_counts_they_cannot_run(script: str, args: list[str], message: str) -> None:
    result = launcher(script, *args, "--dry-run" if script == "slurm_train.py" else "--", "--steps", "1")
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and not result.stdout
