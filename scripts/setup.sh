#!/usr/bin/env bash
# Sets up everything epcc needs, idempotently; safe to re-run (`make setup`).
#
#   1. .venv/ at the repo root (python3 >= 3.10), with `pip install -e '.[test,runtime]'`.
#      Re-installed only when pyproject.toml / setup.py change (stamp file
#      .venv/.epcc-stamp holds their hash).
#   2. Graphviz's `dot` (Debian package graphviz) if it is not on PATH; also
#      cmake and a C compiler if missing.
#   3. The native parts (CMakeLists.txt), configured and built in build/native.
#
# Environment: EPCC_PYTHON=/path/to/python3 picks the interpreter for the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
STAMP="$VENV/.epcc-stamp"
BUILD="$ROOT/build/native"

say() { printf '==> %s\n' "$*"; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }

# ---- system packages (apt-get) ----------------------------------------------
APT_UPDATED=0
apt_install() {
    local sudo=""
    if ! command -v apt-get >/dev/null 2>&1; then
        die "need Debian package(s) '$*' but apt-get is not available; install them by other means and re-run"
    fi
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || die "need Debian package(s) '$*': not root and no sudo; install them and re-run"
        sudo="sudo"
    fi
    if [ "$APT_UPDATED" -eq 0 ]; then
        say "apt-get update"
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
            || die "apt-get update failed; install '$*' by hand and re-run"
        APT_UPDATED=1
    fi
    say "apt-get install $*"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
        || die "apt-get install $* failed; install it by hand and re-run"
}

missing=()
command -v dot   >/dev/null 2>&1 || missing+=(graphviz)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v make  >/dev/null 2>&1 || missing+=(make)
{ command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; } || missing+=(gcc libc6-dev)
# RDMA transports (backends/rdma): libfabric (its tcp provider runs the multi-process tests) and
# the rdma-core headers the ibverbs transport compiles against.
[ -f /usr/include/rdma/fabric.h ] || missing+=(libfabric-dev)
command -v fi_info >/dev/null 2>&1 || missing+=(libfabric-bin)
[ -f /usr/include/infiniband/verbs.h ] || missing+=(libibverbs-dev)
if [ "${#missing[@]}" -gt 0 ]; then
    apt_install "${missing[@]}"
fi
command -v dot >/dev/null 2>&1 || die "'dot' is still not on PATH after installing graphviz"
say "graphviz: $(dot -V 2>&1)"

# ---- Python venv ------------------------------------------------------------
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; }

find_python() {
    local cand
    for cand in ${EPCC_PYTHON:-} python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$cand" >/dev/null 2>&1 && py_ok "$cand"; then
            command -v "$cand"
            return 0
        fi
    done
    return 1
}

if [ -x "$VENV/bin/python" ] && ! py_ok "$VENV/bin/python"; then
    say ".venv is broken or too old; recreating it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)" || die "need python3 >= 3.10 (set EPCC_PYTHON=/path/to/python3)"
    say "creating .venv with $PY ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV" || die "'$PY -m venv' failed (on Debian: apt-get install python3-venv)"
fi

# A fresh install writes ~2.2 GB into .venv, and pip unpacks what it downloads (up to ~1 GB) in its
# temporary directory first.  A CI machine once ran out of disk half-way through (ENOSPC from pip);
# check first and say what is short and where.  When the temporary directory's file system is the
# small one, pip works in build/pip-tmp beside the venv instead.  --no-cache-dir: no second copy of
# the wheels in ~/.cache/pip.
VENV_NEED_MB=2600
TMP_NEED_MB=1200
free_mb() { df -Pm "$1" 2>/dev/null | awk 'NR == 2 { print $4 }'; }
check_disk() {
    local venv_free tmp tmp_free
    venv_free="$(free_mb "$VENV")"
    tmp="${TMPDIR:-/tmp}"
    tmp_free="$(free_mb "$tmp")"
    say "disk: $VENV has ${venv_free:-?} MB free, $tmp ${tmp_free:-?} MB"
    if [ -n "$venv_free" ] && [ "$venv_free" -lt "$VENV_NEED_MB" ]; then
        die "not enough disk for the Python packages: $VENV's file system has ${venv_free} MB free, a fresh install needs ~${VENV_NEED_MB} MB; free some space and re-run"
    fi
    if [ -n "$tmp_free" ] && [ "$tmp_free" -lt "$TMP_NEED_MB" ]; then
        mkdir -p "$ROOT/build/pip-tmp"
        export TMPDIR="$ROOT/build/pip-tmp"
        venv_free="$(free_mb "$TMPDIR")"
        if [ -n "$venv_free" ] && [ "$venv_free" -lt $((VENV_NEED_MB + TMP_NEED_MB)) ]; then
            die "not enough disk: $tmp has ${tmp_free} MB free and $ROOT's file system ${venv_free} MB; a fresh install needs ~${TMP_NEED_MB} MB of temporary space and ~${VENV_NEED_MB} MB for .venv"
        fi
        say "pip's temporary files go to $TMPDIR ($tmp is short of space)"
    fi
}

# The stamp covers what decides the installed set, and where the repo is
# (the editable install points at this checkout).
install_inputs() { local f; for f in pyproject.toml setup.py; do if [ -f "$f" ]; then cat "$f"; fi; done; }
want_stamp="$(install_inputs | sha256sum | cut -d' ' -f1) $ROOT"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$want_stamp" = "$have_stamp" ] && [ -x "$VENV/bin/epcc" ]; then
    say "python packages up to date ($VENV)"
else
    rm -f "$STAMP"
    check_disk
    say "upgrading pip in .venv"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir --upgrade pip
    say "pip install -e '.[test,runtime]' (a fresh venv downloads the MLIR/LLVM wheels and torch: ~2.2 GB installed)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir -e '.[test,runtime]'
    [ -x "$VENV/bin/epcc" ] || die "installed, but there is no .venv/bin/epcc"
    (cd / && "$VENV/bin/python" -c 'import epcc, epcc.dialect') \
        || die "installed, but 'import epcc, epcc.dialect' fails"
    printf '%s\n' "$want_stamp" > "$STAMP"
    say "python packages installed"
fi

# ---- native parts -------------------------------------------------------------
# Configuring every time is cheap once cached, and picks up a venv made after
# the first configure (the ir_verify test depends on it).
say "cmake configure + build -> build/native"
mkdir -p "$BUILD"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$BUILD/setup-configure.log" 2>&1 \
    || { cat "$BUILD/setup-configure.log" >&2; die "cmake configure failed"; }
cmake --build "$BUILD" --parallel "$(nproc 2>/dev/null || echo 2)" >"$BUILD/setup-build.log" 2>&1 \
    || { cat "$BUILD/setup-build.log" >&2; die "native build failed"; }

say "setup done: $VENV/bin/epcc, $BUILD"
