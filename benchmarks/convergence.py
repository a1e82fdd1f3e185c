"""Communication against convergence, side by side: what each update policy and data partition costs in bytes and
gains or loses in validation loss. Prints one JSON report and draws a PNG (with the `plot` extra installed).

    python benchmarks/convergence.py                         # both experiments, 8 simulated CPU devices (~10 min)
    python benchmarks/convergence.py --only policies --steps 200 --out runs/convergence

- policies: gpt-tiny on tinyshakespeare (../shared/data; the built-in text when absent), 8 replicas (mesh
  replica=8): synchronous, local_sgd (H = 4, 16), diloco (H = 16) and stale (tau = 1, 4). Validation loss against
  the step and against the bytes each device has sent across replicas, counted from the compiled step's HLO.
- partitions: the MLP on digits, 8 replicas, uniform | stratified | by_label data, synchronous vs local_sgd
  (H = 16), two seeds each: final validation accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED_DATA = ROOT.parent / "shared" / "data"  # beside the checkout, where the project's data lives
os.environ.setdefault("JAXTRAIN_DATA_DIR", str(SHARED_DATA))

POLICIES = {
    "synchronous": ["updates.policy=synchronous"],
    "local_sgd H=4": ["updates.policy=local_sgd", "updates.average_every=4"],
    "local_sgd H=16": ["updates.policy=local_sgd", "updates.average_every=16"],
    "diloco H=16": ["updates.policy=diloco", "updates.average_every=16"],
    "stale tau=1": ["updates.policy=stale", "staleness=1"],
    "stale tau=4": ["updates.policy=stale", "staleness=4"],
}
PARTITIONS = ("uniform", "stratified", "by_label")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(model: str, overrides: list[str]) -> tuple[dict, object]:
    """Train to the end; the summary (with the logged history) and the compiled setup it used."""
    from jaxtrain.run_config import apply_overrides, default_config
    from jaxtrain.training.loop import train
    from jaxtrain.training.setup import build

    cfg = apply_overrides(default_config(model), [*overrides, "progress=false"])
    summary = train(cfg, log=lambda *_: None)
    return summary, build(cfg, log=lambda *_: None)


def bytes_per_sync(setup) -> float:
    """Bytes each device sends across replicas each time the replicas meet (every step unless local)."""
    from jaxtrain.analysis.comm_report import communication_report

    return communication_report(setup.train_step, setup.shardings.mesh).measured(("replica",))


def syncs_by(step: int, cfg) -> int:
    """How many times the replicas have met after `step` steps of run `cfg` (local policies meet every
    `updates.average_every` steps and at the last one, the others every step)."""
    every = cfg.updates.average_every if cfg.updates.policy in ("local_sgd", "diloco") else 1
    steps = cfg.train.steps
    return step // every + (1 if step == steps and steps % every else 0)


def policies(args) -> dict:
    text = SHARED_DATA / "tinyshakespeare.txt"
    source = str(text) if text.is_file() else "builtin"
    base = ["mesh=replica=8", f"data.source={source}", f"steps={args.steps}", "batch_size=32", "seq_len=64"]
    base += [f"eval_every={args.eval_every}", "eval_batches=8", "log_every=1000"]
    curves = {}
    for name, overrides in POLICIES.items():
        log(f"policies: {name}")
        summary, setup = run("gpt-tiny", [*base, *overrides])
        per_sync = bytes_per_sync(setup)
        points = [r for r in summary["history"] if "val_loss" in r]
        curves[name] = {
            "bytes_per_sync": per_sync,
            "step": [r["step"] for r in points],
            "val_loss": [round(r["val_loss"], 4) for r in points],
            "bytes_sent": [syncs_by(r["step"], setup.cfg) * per_sync for r in points],
            "final_val_loss": round(points[-1]["val_loss"], 4),
            "total_mb_sent": round(syncs_by(args.steps, setup.cfg) * per_sync / 1e6, 2),
            "step_time_s": round(summary["step_time_s"], 4),
        }
    return {"data": source, "mesh": "replica=8", "steps": args.steps, "curves": curves}


def partitions(args) -> dict:
    if not (SHARED_DATA / "digits.csv.gz").is_file():
        return {"skipped": f"{SHARED_DATA / 'digits.csv.gz'} is absent"}
    base = ["mesh=replica=8", f"steps={args.digit_steps}", "batch_size=64", f"eval_every={args.digit_steps}"]
    base += ["eval_batches=6", "log_every=1000"]
    table: dict[str, dict[str, dict]] = {}
    for sync in ("synchronous", "local_sgd"):
        for partition in PARTITIONS:
            log(f"partitions: {sync} {partition}")
            overrides = [*base, f"updates.policy={sync}", "updates.average_every=16", f"data.partition={partition}"]
            accuracy = [run("mlp", [*overrides, f"seed={seed}"])[0]["val_accuracy"] for seed in args.seeds]
            table.setdefault(sync, {})[partition] = {
                "val_accuracy": [round(a, 4) for a in accuracy],
                "mean": round(statistics.mean(accuracy), 4),
            }
    return {"model": "mlp (digits)", "mesh": "replica=8", "steps": args.digit_steps, "average_every": 16, **table}


def plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn: pip install -e .[plot] (matplotlib)"
    curves = report["policies"]["curves"]
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        by_step.plot(c["step"], c["val_loss"], label=name)
        by_bytes.plot([b / 1e6 for b in c["bytes_sent"]], c["val_loss"], marker=".", label=name)
    by_step.set(xlabel="step", ylabel="validation loss (nats/byte)", title="loss vs step")
    by_bytes.set(xlabel="MB sent per device across replicas", ylabel="validation loss", title="loss vs communication")
    by_bytes.set_xscale("symlog", linthresh=1.0)
    by_step.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="policies,partitions")
    parser.add_argument("--steps", type=int, default=400, help="policies: training steps")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--digit-steps", type=int, default=300, help="partitions: training steps")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "convergence")
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    from jaxtrain.devices import enable_compilation_cache

    enable_compilation_cache()  # the step compiled for training comes back from the cache for the bytes report

    experiments = {"policies": policies, "partitions": partitions}
    report = {name: experiments[name](args) for name in args.only.split(",")}
    if "policies" in report:
        report["plot"] = plot(report, args.out / "convergence.png")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
