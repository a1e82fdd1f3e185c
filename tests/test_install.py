"""The project installed non-editable, as a user gets it: the wheel built from the tracked files, installed into a
fresh venv outside the checkout, runs the main job and a plan from another directory, on the installed copy, with
the shipped mesh layouts found as package data; with the tpu-aot and gpu-aot extras, `jaxtrain plan --aot-topology`
compiles for a TPU slice and a GPU node from the installed copy (the GPU specs, gpu_targets/*.txtpb, are package data).

Offline: the fresh venv takes its dependencies (JAX & co) from this interpreter's site-packages through a .pth file.
Python adds the paths a .pth file lists to sys.path without reading the .pth files inside them, so the dev venv's
own editable install of jaxtrain (a .pth that installs an import finder for the checkout) stays off; the test
checks that it does.
"""

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers import aot_target

# Building, installing and the two commands took 57 s under load (21 s on a quiet machine): over the default suite's
# budget for one test.
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
BUILD_LEFTOVERS = ("build", "dist", "*.egg-info")  # what building in place would leave in the checkout
# The process the console script starts: where its modules come from, whether the editable finder ran.
PROBE = """
import json, sys
import importlib.util, jaxtrain, jaxtrain.cli, jaxtrain.training.loop, jaxtrain_models
from jaxtrain.sharding.mesh import MESHES_DIR, available_layouts
files = [m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
print(json.dumps({"jaxtrain": jaxtrain.__file__, "meshes": str(MESHES_DIR), "layouts": available_layouts(),
                  "files": files, "path": sys.path, "editable_finder": any("editable" in m for m in sys.modules),
                  "models": jaxtrain_models.__file__, "bare_models": importlib.util.find_spec("models") is not None}))
"""


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def copy_tracked_files(dest: Path) -> Path:
    """The files git tracks (and new ones it does not ignore), as they are in the working tree, copied to `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not in the wheel either
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(source.read_bytes())
    return dest


def build_wheel(source: Path, out: Path, env: dict[str, str]) -> Path:
    """The wheel of `source`. With setuptools in this venv (the dev extra has it) the build needs no network;
    without, pip fetches the build backend from its index into an isolated build environment."""
    flags = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), *flags, str(source)], out, env)
    [wheel] = out.glob("jaxtrain-*.whl")
    return wheel


def fresh_venv(where: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A venv with only `wheel` installed in it; its dependencies come from this interpreter's site-packages."""
    run([sys.executable, "-m", "venv", "--without-pip", str(where)], where.parent, env)
    python = where / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], where, env).strip())
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        where,
        env,
    )
    return where / "bin"


def leftovers() -> set[Path]:
    return {path for pattern in BUILD_LEFTOVERS for path in ROOT.glob(pattern)}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh venv's bin directory, a working directory outside the checkout, the environment to run in, the
    wheel)."""
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: the wheel is built from the files git tracks")
    before = leftovers()
    work = tmp_path_factory.mktemp("install")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.pop("JAXTRAIN_DATA_DIR", None)  # the installed copy needs nothing beside the checkout
    env.update(JAX_PLATFORMS="cpu", JAXTRAIN_COMPILATION_CACHE=str(work / "xla"), JAXTRAIN_CPU_PEAK_FLOPS="1e11")
    (work / "dist").mkdir()
    wheel = build_wheel(copy_tracked_files(work / "src"), work / "dist", env)
    bin_dir = fresh_venv(work / "venv", wheel, env)
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    assert leftovers() == before, f"building left {sorted(leftovers() - before)} in the checkout"
    return bin_dir, elsewhere, env, wheel


def test_the_wheel_ships_the_models_under_a_name_of_its_own(installed):
    """models/ installs as `jaxtrain_models`, which the entry point names: no top-level `models` (or any other
    package of the checkout's top level) to clash with another project's."""
    *_, wheel = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"jaxtrain", "jaxtrain_models"}, sorted(top_level)
    assert {"jaxtrain_models/__init__.py", "jaxtrain_models/gpt.py"} <= set(names)
    assert "builtin = jaxtrain_models" in declared, declared


def test_the_installed_copy_runs_not_the_checkout(installed):
    bin_dir, elsewhere, env, _ = installed
    probe = json.loads(run([str(bin_dir / "python"), "-c", PROBE], elsewhere, env).splitlines()[-1])
    site = bin_dir.parent / "lib"
    assert Path(probe["jaxtrain"]).is_relative_to(site), probe["jaxtrain"]
    assert Path(probe["models"]).is_relative_to(site) and not probe["bare_models"], probe["models"]
    assert not probe["editable_finder"], "the dev venv's editable install of jaxtrain ran in the fresh venv"
    # The dependencies come from the dev venv, which CI creates inside the checkout: only files outside it count.
    dev_venv = Path(sys.prefix).resolve()
    ours = [
        f
        for f in probe["files"]
        if Path(f).resolve().is_relative_to(ROOT) and not Path(f).resolve().is_relative_to(dev_venv)
    ]
    assert not ours, f"modules were imported from the checkout: {ours[:5]}"
    assert str(ROOT) not in probe["path"]
    assert Path(probe["meshes"]).is_relative_to(site) and {"cpu8-3d", "tpu-v5p-128"} <= set(probe["layouts"])
    script = (bin_dir / "jaxtrain").read_text().splitlines()[0]
    assert script == f"#!{bin_dir / 'python'}", script  # the console script runs the interpreter probed above


def test_installed_jaxtrain_trains_and_plans(installed):
    bin_dir, elsewhere, env, _ = installed
    jaxtrain = str(bin_dir / "jaxtrain")
    trained = run(
        [
            jaxtrain,
            "train",
            "--simulated-devices",
            "8",
            "--mesh",
            "cpu8-3d",
            "--model",
            "gpt-tiny",
            "--steps",
            "3",
            "--no-progress",
        ],
        elsewhere,
        env,
    )
    assert "Mesh data=2 fsdp=2 tensor=2: 8 cpu devices" in trained  # the shipped cpu8-3d layout
    assert "done: steps 3" in trained
    planned = run(
        [jaxtrain, "plan", "--mesh", "tpu-v5p-128", "--model", "gpt-1b", "--chip", "v5p", "--devices", "64"],
        elsewhere,
        env,
    )
    assert "mesh 'tpu-v5p-128' (fsdp=16 tensor=4; 64 x v5p)" in planned
    assert "verdict: fits" in planned


@pytest.mark.parametrize(
    "target,mesh,model,describes",
    [
        ("v5p:2x2x2", "cpu8-fsdp", ["--model", "gpt-tiny"], "v5p:2x2x2 (8 TPU v5 devices, compile-only)"),
        (
            "h100:8",
            "gpu-1x8",
            ["--model", "mlp-tiny", "data.source=synthetic"],
            "h100:8 (8 NVIDIA H100 80GB HBM3 devices, compile-only)",
        ),
    ],
    ids=["tpu", "gpu"],
)
def test_installed_jaxtrain_compiles_for_hardware_it_lacks(installed, target, mesh, model, describes):
    aot_target(target)  # skips without the extra, except under CI
    bin_dir, elsewhere, env, _ = installed
    argv = [str(bin_dir / "jaxtrain"), "plan", "--aot-topology", target, "--mesh", mesh, "--batch-size", "8", *model]
    planned = run(argv, elsewhere, env)
    assert f"check: compiled the train step for {describes} in " in planned
    assert "compiled verdict: fits: live " in planned
