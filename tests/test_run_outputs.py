"""What a training run writes for its user: the concise preflight, the JSONL metrics, the same values as TensorBoard
scalars and as an offline Weights & Biases run (both read back from their files with readers written here), and each
record handed to a callback."""

import json
import os
import shutil
import signal
import struct
import sys
import threading
import zlib
from pathlib import Path

import jax
import pytest
from helpers import TINY
from test_checkpoint import config

from jaxtrain.cli import _run_config, _train_parser
from jaxtrain.run_config import apply_overrides, default_config
from jaxtrain.training.loop import train
from jaxtrain.training.metrics import MetricsError
from jaxtrain.training.recovery import Preempted
from jaxtrain.training.run_identity import config_json, fingerprint
from jaxtrain.training.tracking import TrackingError, resolved_mode


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: what TFRecord framing checksums with."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tfrecords(path) -> list[bytes]:
    """Records of a TFRecord file: u64 length, u32 masked CRC of the length, data, u32 masked CRC of the data."""
    data, records, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (length_crc,) = struct.unpack_from("<I", data, at + 8)
        assert length_crc == masked_crc(data[at : at + 8])
        record = data[at + 12 : at + 12 + length]
        (record_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert record_crc == masked_crc(record)
        records.append(record)
        at += 12 + length + 4
    return records


def tensorboard_scalars(directory) -> dict[tuple[str, int], float]:
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    [events] = directory.glob("events.out.tfevents.*")
    for record in read_tfrecords(events):
        event = Event.FromString(record)
        for value in event.summary.value:
            scalars[value.tag, event.step] = value.simple_value
    return scalars


def wandb_records(path) -> list:
    """The protobuf records of an offline W&B run file (`run-*.wandb`): a 7-byte header (":W&B", magic 0xBEE1,
    version), then LevelDB's log format: 32 KiB blocks of chunks, each u32 CRC-32 of its type byte and data, u16
    length, u8 type (1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack_from("<4sHB", data) == (b":W&B", 0xBEE1, 0)
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:  # a block's tail too short for a chunk header is padding
            at += 32768 - at % 32768
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, at)
        if kind == 0:
            break  # zeroed padding at the end of the file
        chunk = data[at + 7 : at + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
        at += 7 + length
    return records


def wandb_scalars(directory) -> tuple[dict[tuple[str, int], float], dict]:
    """(key, step) -> value of the logged history, and the run's config, of the one offline run under `directory`."""
    [path] = directory.glob("wandb/offline-run-*/run-*.wandb")
    scalars, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("_step")
            scalars.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    return scalars, config


def test_crc32c_reference_value():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of the CRC-32C catalogue entry


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    overrides = ["steps=3", "log_every=1", "eval_every=2", "eval_batches=1", "progress=false", "mesh=data=8"]
    overrides += [f"metrics_file={out / 'metrics.jsonl'}", f"tensorboard_dir={out / 'tb'}"]
    overrides += ["wandb_project=jaxtrain-tests", "wandb_mode=offline", f"wandb_dir={out / 'wb'}"]
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, *overrides])
    lines, records = [], []
    summary = train(cfg, log=lines.append, on_metrics=records.append)
    return out, lines, records, summary


def test_tensorboard_scalars_equal_the_jsonl(trained):
    out, _, records, _ = trained
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(out / "tb")
    expected = {(k, r["step"]): v for r in jsonl for k, v in r.items() if k not in ("step", "run")}
    assert {"loss", "val_loss", "tokens_per_sec", "mfu", "grad_norm"} <= {k for k, _ in expected}
    assert scalars.keys() == expected.keys()
    for key, value in expected.items():
        assert scalars[key] == pytest.approx(value, rel=1e-6), key  # TensorBoard keeps float32
    assert records == jsonl  # the callback saw each record as written


def test_wandb_offline_run_holds_the_jsonl_scalars_and_the_config(trained):
    out, lines, _, summary = trained
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {(k, r["step"]): v for r in jsonl for k, v in r.items() if k not in ("step", "run")}
    scalars, config = wandb_scalars(out / "wb")
    assert scalars == expected
    assert config["model"]["d_model"] == summary["run"].cfg.model.d_model
    assert any(line.startswith("W&B: offline run") and "wandb sync" in line for line in lines)


def wandb_service_pids() -> list[int]:
    """The W&B service processes (`wandb-core`) this process started, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if "wandb" in name and int(fields[1]) == os.getpid():
            pids.append(int(stat.parent.name))
    return pids


@pytest.fixture
def lagging_wandb_service(monkeypatch):
    """The W&B service is stopped for a second as each run finishes, as a loaded machine may leave it unscheduled:
    `Run.finish()` returns once it has informed the service, which writes the run file when it closes the run."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    real_inform = ServiceConnection.inform_finish

    def stall_then_inform(self, *args, **kwargs):
        for pid in wandb_service_pids():
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(1.0, os.kill, (pid, signal.SIGCONT)).start()
        real_inform(self, *args, **kwargs)

    monkeypatch.setattr(ServiceConnection, "inform_finish", stall_then_inform)


def stop_at_step_2(how: str):
    """An `on_metrics` callback that ends the run at step 2 the way `how` says."""

    def on_metrics(record: dict) -> None:
        if record["step"] != 2:
            return
        if how == "exception":
            raise RuntimeError("planted")
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # the loop finishes the step, then stops as preempted

    return on_metrics


@pytest.mark.parametrize(
    "how, raised",
    [("end", None), ("exception", RuntimeError), ("interrupt", KeyboardInterrupt), ("sigterm", Preempted)],
)
def test_the_wandb_run_holds_the_jsonl_scalars_however_training_ends(tmp_path, lagging_wandb_service, how, raised):
    overrides = ["steps=4", "log_every=1", "eval_every=1000", "progress=false", "mesh=data=8"]
    overrides += [f"metrics_file={tmp_path / 'metrics.jsonl'}", f"tensorboard_dir={tmp_path / 'tb'}"]
    overrides += ["wandb_project=jaxtrain-tests", "wandb_mode=offline", f"wandb_dir={tmp_path / 'wb'}"]
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, *overrides])
    if raised:
        with pytest.raises(raised):
            train(cfg, log=lambda *_: None, on_metrics=stop_at_step_2(how))
    else:
        train(cfg, log=lambda *_: None)
    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == list(range(1, len(jsonl) + 1)) and len(jsonl) >= 2
    expected = {(k, r["step"]): v for r in jsonl for k, v in r.items() if k not in ("step", "run")}
    assert wandb_scalars(tmp_path / "wb")[0] == expected
    assert tensorboard_scalars(tmp_path / "tb").keys() == expected.keys()


def test_preflight_is_concise_by_default(trained):
    _, lines, _, summary = trained
    text = "\n".join(lines)
    assert lines[0] == "Mesh data=8: 8 cpu devices"  # the header alone, no device grid
    assert "bytes/device" not in text and "runs/step" not in text  # neither table
    state = summary["state"]
    count = sum(x.size for x in jax.tree.leaves(state["params"]))
    param_bytes = 4 * count  # float32, every parameter replicated on data=8
    assert f"params: {count:,} (" in text
    comm = next(line for line in lines if line.startswith("communication per step:"))
    # A ring all-reduce of the gradient over 8 devices sends 2(N-1)/N = 1.75x its bytes from each device.
    number, unit = comm.split(": ")[1].split()[:2]
    sent = float(number) * 1024 ** ["B", "KiB", "MiB", "GiB"].index(unit)
    assert sent == pytest.approx(1.75 * param_bytes, rel=0.02)
    assert "(data " in comm
    preflight = lines[: next(i for i, line in enumerate(lines) if line.startswith("model FLOPs"))]
    assert len(preflight) == 4  # mesh, params, memory, communication


def test_flags_reach_the_config():
    args = _train_parser().parse_args(["--verbose", "--tensorboard-dir", "runs/tb", "--model", "gpt-tiny"])
    cfg = _run_config(args)
    assert cfg.train.verbose is True and cfg.tracking.tensorboard_dir == "runs/tb"


def test_missing_tensorboardx_is_a_clear_error_before_compiling(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX now raises ImportError
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, f"tensorboard_dir={tmp_path}"])
    with pytest.raises(MetricsError, match=r"pip install 'jaxtrain\[tensorboard\]'"):
        train(cfg, log=lambda *_: pytest.fail("setup started"))


def test_missing_wandb_is_a_clear_error_before_compiling(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, "wandb_project=p"])
    with pytest.raises(TrackingError, match=r"pip install 'jaxtrain\[wandb\]'"):
        train(cfg, log=lambda *_: pytest.fail("setup started"))


def test_wandb_goes_online_only_with_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert resolved_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    (tmp_path / ".netrc").chmod(0o600)  # netrc refuses a password file others can read
    assert resolved_mode("auto") == "online"
    assert resolved_mode("offline") == "offline"


def test_a_resumed_run_drops_the_rows_it_redoes(tmp_path):
    """Crashed after step 4's checkpoint with rows up to 6 written: the rerun replaces rows 5 and 6, so the file holds
    each step once, and TensorBoard is told to purge the events from step 5 on."""
    directory, metrics, board = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "tb"
    outputs = [f"metrics_file={metrics}", f"tensorboard_dir={board}"]
    first = train(config("data=8", directory, outputs), log=lambda *_: None)["history"]
    shutil.rmtree(directory / "6")
    second = train(config("data=8", directory, outputs), log=lambda *_: None)["history"]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    name = fingerprint(config_json(config("data=8", directory)))
    assert rows == [{**r, "run": name} for r in first[:4] + second]
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    events = [Event.FromString(r) for path in board.glob("events.out.tfevents.*") for r in read_tfrecords(path)]
    assert [e.step for e in events if e.session_log.status == SessionLog.START] == [5]


def test_a_rerun_replaces_its_own_rows_and_never_touches_another_runs(tmp_path):
    """A run without checkpoints, run again (as after a kill before its first checkpoint): it starts at step 0 and
    replaces its own rows. A run of another config is refused before compiling, and the file is left as it was, as
    is a file of rows that name no run, or of lines that are not metrics at all."""
    metrics = tmp_path / "m.jsonl"
    outputs = ["steps=3", "log_every=1", "eval_every=2", "eval_batches=1", "progress=false", "mesh=data=8"]
    cfg = apply_overrides(default_config("gpt-tiny"), [*TINY, *outputs, f"metrics_file={metrics}"])
    train(cfg, log=lambda *_: None)
    with open(metrics, "a") as f:
        f.write('{"step": 4, "lo')  # a write cut short by the kill
    train(cfg, log=lambda *_: None)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]

    name, before = fingerprint(config_json(cfg)), metrics.read_text()
    other = apply_overrides(cfg, ["seed=1"])
    with pytest.raises(MetricsError) as refused:
        train(other, log=lambda line: pytest.fail(f"got as far as: {line}"))
    assert str(refused.value).startswith(
        f"metrics file {metrics} holds 3 rows (steps 1-3) of another run ({name}; this one is "
        f"{fingerprint(config_json(other))}), which this run will not mix with nor drop. Give another --metrics-file"
    )
    assert metrics.read_text() == before

    for content, message in [
        ('{"step": 1, "loss": 5.6}\n', "holds a row \\(step 1\\) of another run \\(unnamed;"),
        ("step,loss\n1,5.6\n", "line 1, is not a metrics record \\('step,loss'\\)"),
    ]:
        metrics.write_text(content)
        with pytest.raises(MetricsError, match=message):
            train(cfg, log=lambda line: pytest.fail(f"got as far as: {line}"))
        assert metrics.read_text() == content
