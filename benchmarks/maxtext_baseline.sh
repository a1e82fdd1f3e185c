#!/usr/bin/env bash
# MaxText baseline measurement helper -- NOT part of the jaxtrain library.
#
# Runs a small MaxText pre-training job (synthetic data, 8 simulated CPU
# devices; by default the issue-2 shape on FSDP=8, global batch 8 x 256 tokens)
# and prints one JSON line:
#   {"framework":"maxtext","tokens_per_sec":...,"step_time_s":...}
# computed as the median over steps 10..STEPS-1 of MaxText's own
# "completed step: N, seconds: S" log lines (tokens/step = 8 devices x
# per_device_batch_size x max_target_length).
#
# Needs a separate Python 3.12 venv with maxtext[tpu]==0.2.5 / jax 0.12.0.1 at
# $MAXTEXT_VENV (default /tmp/maxtext_venv); it is created if missing
# (needs PyPI access, ~2.5 min on 2 cores).
#
# The decoder's MLP and key/value heads come from the overrides (MaxText's defaults: SwiGLU, as many kv heads as
# query heads): GPT's shape is base_num_kv_heads=4 'mlp_activations=[gelu]', the Llama one base_num_kv_heads=2.
#
# Usage: benchmarks/maxtext_baseline.sh [STEPS] [MaxText key=value overrides...]
#   An override replaces the default of its key (shape: base_emb_dim, base_num_decoder_layers, max_target_length,
#   per_device_batch_size, ...; mesh: ici_fsdp_parallelism, ici_data_parallelism, ...).
#   e.g. benchmarks/maxtext_baseline.sh 30 base_num_kv_heads=4 'mlp_activations=[gelu]'
#        benchmarks/maxtext_baseline.sh 30 base_num_kv_heads=4 ici_fsdp_parallelism=1 ici_data_parallelism=8
# Env: MAXTEXT_VENV, MAXTEXT_LOG (full log, default /tmp/maxtext_baseline.log),
#      MAXTEXT_OUT (base_output_directory, default /tmp/maxtext_out).
set -euo pipefail

STEPS="${1:-30}"
shift || true
VENV="${MAXTEXT_VENV:-/tmp/maxtext_venv}"
LOG="${MAXTEXT_LOG:-/tmp/maxtext_baseline.log}"
OUT="${MAXTEXT_OUT:-/tmp/maxtext_out}"
PY312="${PY312:-/root/.pyenv/versions/3.12.1/bin/python3}"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import maxtext" >/dev/null 2>&1; then
  echo "[maxtext_baseline] creating venv at $VENV" >&2
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip >&2
  "$VENV/bin/pip" install -q 'maxtext[tpu]==0.2.5' 'jax==0.12.0.1' 'jaxlib==0.12.0.1' >&2
fi

BASE_YML="$("$VENV/bin/python" -c 'import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"))' 2>/dev/null)"

RUN_NAME="baseline_$(date +%s)"
# The issue-2 shape on fsdp=8; an override KEY=VALUE replaces the default of that KEY.
DEFAULTS=(base_emb_dim=256 base_num_query_heads=4 head_dim=64 base_mlp_dim=1024 base_num_decoder_layers=4
  vocab_size=256 max_target_length=256 per_device_batch_size=1 ici_fsdp_parallelism=8 attention=dot_product)
ARGS=()
for default in "${DEFAULTS[@]}"; do
  keep=1
  for override in "$@"; do [ "${override%%=*}" = "${default%%=*}" ] && keep=0; done
  [ "$keep" = 1 ] && ARGS+=("$default")
done
ARGS+=("$@")
echo "[maxtext_baseline] running $STEPS steps (${ARGS[*]}), log -> $LOG" >&2
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  "$VENV/bin/python" -m maxtext.trainers.pre_train.train "$BASE_YML" \
  run_name="$RUN_NAME" base_output_directory="$OUT" dataset_type=synthetic steps="$STEPS" \
  enable_checkpointing=False hardware=cpu skip_jax_distributed_system=True "${ARGS[@]}" >"$LOG" 2>&1 \
  || { echo "[maxtext_baseline] MaxText failed; tail of $LOG:" >&2; tail -20 "$LOG" >&2; exit 1; }

"$VENV/bin/python" - "$LOG" "$STEPS" "${ARGS[@]}" <<'EOF'
import json, re, statistics, sys
log, steps = sys.argv[1], int(sys.argv[2])
settings = dict(arg.split("=", 1) for arg in sys.argv[3:])
pat = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+)")
rows = [(int(m[1]), float(m[2]), float(m[3])) for line in open(log) if (m := pat.search(line))]
first = 10 if steps > 12 else max(1, steps // 3)  # skip compile / warm-up steps
sel = [r for r in rows if r[0] >= first] or rows
if not sel:
    sys.exit(f"no 'completed step' lines in {log}")
t = statistics.median(r[1] for r in sel)
tokens_per_step = 8 * int(settings["per_device_batch_size"]) * int(settings["max_target_length"])  # 8 devices
print(json.dumps({
    "framework": "maxtext",
    "tokens_per_sec": round(tokens_per_step / t, 1),
    "step_time_s": round(t, 4),
    "tflops_per_device": statistics.median(r[2] for r in sel),
    "steps_measured": len(sel),
    "first_step_measured": first,
}))
EOF
