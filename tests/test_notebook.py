"""The notebooks run top to bottom on a fresh kernel, what they show holds, and their figures are the ones committed
with them. notebooks/quickstart.ipynb: the same losses on both meshes, the bytes each device holds and sends, a
checkpoint restored onto the other mesh, re-running cells is safe. notebooks/bring_your_own.ipynb: a model defined
and registered in the notebook trains on token ids in memory with its one-device losses, generates text, trains on a
corpus it tokenized with a BPE it trained, and plans onto a TPU pod through the TPU compiler."""

import ast
import base64
import io
import json
import re
from pathlib import Path

import nbformat
import numpy as np
import pytest
from helpers import aot_target
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
BRING_YOUR_OWN = ROOT / "notebooks" / "bring_your_own.ipynb"
GPT_TINY_PARAMS = 131_392  # embedding 256x64 + 2 layers of (qkv 64x192, out 64x64, mlp 2x64x256, 2 norms) + ...


def tagged(nb, tag: str) -> tuple[int, nbformat.NotebookNode]:
    [(index, cell)] = [(i, c) for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]
    return index, cell


def stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def has_image(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


def executed(path: Path) -> tuple[nbformat.NotebookNode, NotebookClient]:
    """The notebook at `path` and a client with a fresh kernel, for `run_all` to execute it in."""
    nb = nbformat.read(path, as_version=4)
    return nb, NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})


def run_all(client: NotebookClient) -> None:
    for index, cell in enumerate(client.nb.cells):
        client.execute_cell(cell, index)


def run_scratch(client: NotebookClient, source: str) -> str:
    """Run `source` in the notebook's kernel (as a cell not in the notebook) and return what it printed."""
    cell = nbformat.v4.new_code_cell(source)
    client.nb.cells.append(cell)  # nbclient stores the executed cell back at its index
    client.execute_cell(cell, len(client.nb.cells) - 1)
    return stdout(cell)


@pytest.fixture
def kernel_env(monkeypatch, tmp_path, optimized_subprocesses):
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_FLOPS", "1e11")  # no peak measurement in the kernel
    monkeypatch.setenv("JAXTRAIN_COMPILATION_CACHE", str(tmp_path / "xla"))  # a clean cache: nothing precompiled
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws the figures


def images(cell) -> list[np.ndarray]:
    """The cell's PNG outputs (a display handle's last update included) as RGB arrays in [0, 1]."""
    import matplotlib.image

    pngs = [o["data"]["image/png"] for o in cell.outputs if "image/png" in o.get("data", {})]
    return [matplotlib.image.imread(io.BytesIO(base64.b64decode(png)))[..., :3] for png in pngs]


def assert_same_figures(executed, committed, at_least: int) -> None:
    """Each tagged cell's figures as committed (scripts/run_notebook.py saved them): the same number and sizes, and
    the same pixels within a tolerance for antialiasing and float rounding in the curves."""
    compared = 0
    for cell in committed.cells:
        tags = cell.metadata.get("tags", [])
        if cell.cell_type != "code" or not tags or not images(cell):
            continue
        got, want = images(tagged(executed, tags[0])[1]), images(cell)
        assert [g.shape for g in got] == [w.shape for w in want], tags[0]
        for g, w in zip(got, want):
            assert np.abs(g - w).mean() < 0.002, tags[0]  # measured: 0 on a rerun, 0.0102 at another learning rate
        compared += len(want)
    assert compared >= at_least, "the committed notebook has lost its figures: run scripts/run_notebook.py on it"


def test_quickstart_runs_and_reruns(kernel_env):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nb, client = executed(NOTEBOOK)
    with client.setup_kernel():
        run_all(client)

        assert stdout(tagged(nb, "devices")[1]).startswith("8 devices")
        assert has_image(tagged(nb, "sharding")[1])
        train = tagged(nb, "train")[1]
        assert has_image(train)  # the live plot
        assert "Mesh data=2 fsdp=2 tensor=2: 8 cpu devices" in stdout(train)  # the notebook's own layout

        result = next(o for o in tagged(nb, "compare")[1].outputs if o.output_type == "execute_result")
        comparison = ast.literal_eval(result.data["text/plain"])
        assert comparison["max_relative_loss_difference"] < 1e-4
        sharded, replicated = comparison["data=2, fsdp=2, tensor=2"], comparison["data=8"]
        assert replicated["params_bytes_per_device"] == 4 * GPT_TINY_PARAMS  # float32, a full copy on each device
        assert sharded["params_bytes_per_device"] < replicated["params_bytes_per_device"] / 3
        # data=8 sends only the gradient's ring all-reduce: 2(N-1)/N = 1.75x its bytes from each device.
        assert replicated["sent_bytes_per_step"] == pytest.approx(1.75 * 4 * GPT_TINY_PARAMS, rel=0.01)
        assert "restored params equal the first run's final params: True" in stdout(tagged(nb, "checkpoint")[1])
        assert_same_figures(nb, committed, at_least=3)
        big = stdout(tagged(nb, "plan-big")[1])  # gpt-1b on 64 H100s: too big as asked, and what would fit
        assert "verdict: does not fit" in big and "changes that fit" in big
        checked = stdout(tagged(nb, "plan-check")[1])  # compiled, or read from the cache of the training cells
        how = r"(compiled the train step|read the compiled train step from JAX's compilation cache)"
        assert re.search(rf"^check: {how} on 8 cpu devices in ", checked, flags=re.M), checked

        # Re-running cells: the device setup again, then the second mesh's training, which gives the same losses.
        losses = 'import json; print(json.dumps([r["loss"] for r in b["history"]]))'
        before = json.loads(run_scratch(client, losses))
        for tag in ("devices", "second-mesh"):
            client.execute_cell(*reversed(tagged(nb, tag)))
        assert json.loads(run_scratch(client, losses)) == before
        assert len(before) == 15  # 30 steps, logged every 2

        with pytest.raises(CellExecutionError, match="DeviceSetupError.*Restart the process"):
            run_scratch(client, "jaxtrain.use_simulated_devices(4)")


def test_bring_your_own_model_and_data(kernel_env):
    aot_target("v5p:2x2x2")  # the last cell compiles for a TPU pod: libtpu must be installed (CI fails without it)
    committed = nbformat.read(BRING_YOUR_OWN, as_version=4)
    nb, client = executed(BRING_YOUR_OWN)
    with client.setup_kernel():
        run_all(client)
        assert stdout(tagged(nb, "devices")[1]).startswith("8 devices")
        assert "ModelSpec(name='windowlm'" in stdout(tagged(nb, "model")[1])  # defined and registered in the notebook

        train = stdout(tagged(nb, "train")[1])
        assert re.search(r"^w_in +\(512, 512\) +embed mlp +fsdp tensor ", train, flags=re.M), train  # split 4 ways
        first, last = map(float, re.search(r"training loss ([\d.]+) -> ([\d.]+) nats per byte", train).groups())
        assert last < first - 1.0  # it learns the user's data
        difference = float(re.search(r"1-device loss curves: ([\d.e+-]+)", train).group(1))
        assert difference < 1e-4  # 8 devices compute what one does
        assert_same_figures(nb, committed, at_least=1)

        generated = stdout(tagged(nb, "generate")[1])
        assert len(re.findall(r"^   ['\"](def|import|    return) ", generated, flags=re.M)) == 6  # 3 prompts, 2 ways
        client.execute_cell(*reversed(tagged(nb, "generate")))  # the same seed and prompts: the same text
        assert stdout(tagged(nb, "generate")[1]) == generated

        corpus = stdout(tagged(nb, "corpus")[1])
        assert "vocab_size from the tokenizer: 1024" in corpus  # a BPE of 1,024 tokens trained in the notebook
        per_byte = float(re.search(r"= ([\d.]+) nats per byte", corpus).group(1))
        assert per_byte < 2.0  # it learned from the shards (uniform over 1,024 tokens would be ~2.4 per byte)
        assert len(re.findall(r"^   ['\"](def|import|    return) ", corpus, flags=re.M)) == 3  # decoded with the BPE

        plan = stdout(tagged(nb, "tpu-plan")[1])
        assert "mesh 'tpu-v5p-128' (fsdp=16 tensor=4; 64 x v5p)" in plan
        assert "check: compiled the train step for v5p:4x4x4 (64 TPU v5 devices, compile-only)" in plan
