#!/bin/sh
# Container entrypoint for xpu-serve.
#   no arguments        -> xpu-serve up -c "$XPU_SERVE_CONFIG" --runtime-dir "$XPU_SERVE_RUNTIME_DIR"
#   arguments "-..."    -> the same, with those extra arguments for `up`
#   other arguments     -> xpu-serve with those arguments (e.g. `diagnose`, `status`, `render`)
# As PID 1 it runs under tini when tini is installed (signals forwarded, zombies reaped);
# otherwise `xpu-serve up` is PID 1 itself and reaps the orphans that are re-parented to it.
set -eu

config="${XPU_SERVE_CONFIG:-/etc/xpu-serve/config.yaml}"
runtime_dir="${XPU_SERVE_RUNTIME_DIR:-/var/lib/xpu-serve}"
xpu_serve="${XPU_SERVE_BIN:-xpu-serve}"

if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    set -- up -c "$config" --runtime-dir "$runtime_dir" "$@"
fi

if [ "$$" = "1" ] && command -v tini >/dev/null 2>&1; then
    exec tini -- "$xpu_serve" "$@"
fi
exec "$xpu_serve" "$@"
