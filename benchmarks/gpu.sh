#!/usr/bin/env bash
# One-shot GPU benchmark of mmenc (see benchmarks/gpu_bench.py for what is measured and how).
#
#   bash benchmarks/gpu.sh OUTDIR            # full: one CUDA GPU, about 5 minutes (at most 9), no network
#   bash benchmarks/gpu.sh --smoke OUTDIR    # the same code at tiny sizes on the CPU (CI)
#
# Installs mmenc from this checkout (pip install --no-deps --no-build-isolation -e .; skipped with
# --smoke when `import mmenc_cli` already resolves here), checks the imports the benchmark needs,
# then runs gpu_bench.py, which prints a table, each goal's figure beside it (met / not met / not
# measured) and writes OUTDIR/gpu_bench.json.
# Environment: PYTHON (default: python); MMENC_BENCH_CACHE (where JPEGs and models are kept;
# default OUTDIR/data). Exit status: 0 all stages ran or were skipped by the time guard; 1 a stage
# failed; 2 usage; 3 a needed import is missing.
set -u
MMENC_GPU_BENCH_T0=$(date +%s.%N)
export MMENC_GPU_BENCH_T0

usage() { echo "usage: bash benchmarks/gpu.sh [--smoke] OUTDIR" >&2; exit 2; }
SMOKE=""
OUTDIR=""
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE="--smoke" ;;
        -h|--help) usage ;;
        -*) echo "unknown option: $arg" >&2; usage ;;
        *) [ -z "$OUTDIR" ] || usage; OUTDIR="$arg" ;;
    esac
done
[ -n "$OUTDIR" ] || usage

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT" || exit 2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# does `import mmenc_cli` (run from elsewhere: not through the working directory) find this checkout?
resolves_here() {
    (cd / && "$PYTHON" -c 'import os, sys, mmenc_cli
sys.exit(0 if os.path.realpath(mmenc_cli.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep) else 1)' \
        "$ROOT" 2>/dev/null)
}

if [ -n "$SMOKE" ] && resolves_here; then
    echo "install: skipped (--smoke, mmenc_cli already imports from $ROOT)"
# offline: no index, no pip self-check (which would wait on the network), bounded in time
elif timeout 60 "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index --disable-pip-version-check \
        --no-input -q -e . >"$OUTDIR/pip-install.log" 2>&1; then
    echo "install: pip install -e . done"
else
    echo "WARNING: pip install --no-deps --no-build-isolation -e . failed (see $OUTDIR/pip-install.log);" \
         "running from the checkout through PYTHONPATH=$ROOT" >&2
    tail -n 5 "$OUTDIR/pip-install.log" >&2
fi

# the checkout first on the path: the benchmark measures this tree even if the install failed
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# every import the stages need; each missing one is named
"$PYTHON" - "$ROOT" <<'EOF' || exit 3
import importlib, os, sys
need = ["torch", "torchvision", "transformers", "sentence_transformers", "tokenizers", "safetensors",
        "pyarrow", "PIL", "numpy", "typer", "rich", "mmenc_cli"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:  # an import can fail with more than ImportError
        missing.append(name)
        print(f"MISSING import {name}: {type(e).__name__}: {e}", file=sys.stderr)
if missing:
    print(f"cannot run the benchmark: missing {', '.join(missing)}", file=sys.stderr)
    sys.exit(1)
import mmenc_cli
where = os.path.dirname(os.path.realpath(mmenc_cli.__file__))
print(f"imports: ok ({len(need)} modules; mmenc_cli from {where})")
if not where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    print(f"WARNING: mmenc_cli imports from {where}, not from this checkout", file=sys.stderr)
EOF

exec "$PYTHON" "$ROOT/benchmarks/gpu_bench.py" "$OUTDIR" $SMOKE
