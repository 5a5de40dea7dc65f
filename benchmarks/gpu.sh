#!/usr/bin/env bash
# The GPU table of docs/benchmarks.md in one call of under 4 minutes: Keras on JAX, no
# TensorFlow (benchmarks/gpu_table.py says what it measures).
#
#   bash benchmarks/gpu.sh [OUTDIR] [--cpu-smoke]
#
# OUTDIR (default: $OUT, else bench_out/gpu) receives gpu_table.md and gpu_log.txt. On the
# lent GPU machine, through the device tool, after `bash benchmarks/gpu_wheels.sh` here:
#
#   run  command: bash benchmarks/gpu.sh "$OUT"   carry: [".whl"]   timeout_s: 300
#
# Steps: install the wheels carried in .whl/ (or $GPU_WHEELS) into /tmp/site (or
# $GPUSHARE_SITE) and put them and the repository on PYTHONPATH; set KERAS_BACKEND=jax; fail
# (exit 4) when JAX sees no GPU; run gpu_table.py within a hard time limit (215 s; its own
# 195 s budget starts no worker or tuner search that would not fit) and print the tables.
# --cpu-smoke runs the same tables at tiny sizes on the CPU (JAX_PLATFORMS=cpu), in about 90 s
# on two cores: the check that needs no GPU. Python: $PYTHON, else the repository's .venv,
# else python3.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

smoke=0
outdir=""
for arg in "$@"; do
    case "$arg" in
    --cpu-smoke) smoke=1 ;;
    -h | --help)
        sed -n '2,18p' "$0"
        exit 0
        ;;
    -*)
        echo "gpu.sh: unknown option $arg; usage: bash benchmarks/gpu.sh [OUTDIR] [--cpu-smoke]" >&2
        exit 2
        ;;
    *) outdir=$arg ;;
    esac
done
outdir=${outdir:-${OUT:-bench_out/gpu}}
mkdir -p "$outdir" || exit 1
table=$outdir/gpu_table.md
log=$outdir/gpu_log.txt
: >"$log"
rm -f "$table"

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi

wheels=${GPU_WHEELS:-.whl}
pythonpath=$PWD
if compgen -G "$wheels/*.whl" >/dev/null; then
    site=${GPUSHARE_SITE:-/tmp/site}
    echo "gpu.sh: installing $(ls "$wheels"/*.whl | wc -l) carried wheels into $site" | tee -a "$log"
    if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$site" "$wheels"/*.whl >>"$log" 2>&1; then
        echo "gpu.sh: installing the wheels of $wheels failed (see $log)" >&2
        exit 3
    fi
    pythonpath=$site:$pythonpath
fi
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
export KERAS_BACKEND=jax
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export PYTHONUNBUFFERED=1
if [ "$smoke" = 1 ]; then
    export JAX_PLATFORMS=cpu
    limit=${GPU_TABLE_TIMEOUT:-180}
    flags=(--cpu-smoke)
else
    limit=${GPU_TABLE_TIMEOUT:-215}
    flags=(--budget "$((limit - 20))")
fi

# What this machine offers; no GPU is a clear failure unless --cpu-smoke.
"$python" - "$smoke" <<'EOF' 2>&1 | tee -a "$log"
import sys

sys.modules["tensorflow"] = None  # the GPU machine has none; nothing here may need it
try:
    import jax
    import keras
except ImportError as e:
    print(f"gpu.sh: cannot import Keras on JAX ({e}). JAX comes with the GPU machine; keras, "
          "namex and optree travel as wheels: run `bash benchmarks/gpu_wheels.sh` where PyPI "
          "answers and name .whl in the device tool's carry.", file=sys.stderr)
    sys.exit(3)
gpus = [d for d in jax.devices() if d.platform == "gpu"]
print(f"gpu.sh: Python {sys.version.split()[0]}, keras {keras.__version__} "
      f"({keras.__file__}), jax {jax.__version__}, devices {jax.devices()}")
if not gpus and sys.argv[1] != "1":
    print("gpu.sh: JAX sees no GPU (no CUDA device, or no jax CUDA plugin). This script "
          "times the GPU table; pass --cpu-smoke to run it at tiny sizes on the CPU.",
          file=sys.stderr)
    sys.exit(4)
EOF
rc=${PIPESTATUS[0]}
if [ "$rc" != 0 ]; then
    exit "$rc"
fi
command -v nvidia-smi >/dev/null && nvidia-smi >>"$log" 2>&1

# The parent writes its own lines to the log too; its errors go to both.
timeout --kill-after=10 "$limit" "$python" benchmarks/gpu_table.py "${flags[@]}" \
    --out "$table" --log "$log" 2> >(tee -a "$log" >&2)
rc=$?
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "gpu.sh: stopped at the ${limit} s limit; $table holds what was measured" | tee -a "$log"
    [ -s "$table" ] && echo "- gpu.sh stopped the run at its ${limit} s limit: rows missing above were not measured." >>"$table"
fi
echo
if [ -s "$table" ]; then
    echo "===== $table"
    cat "$table"
else
    echo "gpu.sh: no table was written (exit $rc); see $log" >&2
    [ "$rc" = 0 ] && rc=1
fi
exit "$rc"
