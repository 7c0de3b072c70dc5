#!/usr/bin/env bash
# Installs what building and testing durable_jobs needs on Debian, skipping what is present:
# PostgreSQL 15 with its server headers, clang for pgrx's bindgen, sudo (pgrx runs the test
# cluster through it), python3's psycopg for the example worker, and cargo-pgrx 0.18.0
# initialised against the system PostgreSQL 15.
set -euo pipefail

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGRX_VERSION=0.18.0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo

packages=(postgresql-15 postgresql-server-dev-15 libclang-dev clang sudo python3)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "Installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# psycopg 3 for the Python example worker (docs/examples/python), which the tests run.
# Debian's own python3 refuses pip installs (PEP 668): it gets Debian's python3-psycopg.
if ! python3 -c "import psycopg" 2>/dev/null; then
    echo "Installing psycopg for python3"
    python3 -m pip install --quiet --disable-pip-version-check "psycopg[binary]>=3.1" 2>/dev/null ||
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-psycopg >/dev/null
fi

if ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION\$"; then
    echo "Installing cargo-pgrx $PGRX_VERSION (several minutes)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked --quiet
fi

if ! grep -qs "^pg15 = \"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
    cargo pgrx init --pg15 "$PG_CONFIG"
fi
