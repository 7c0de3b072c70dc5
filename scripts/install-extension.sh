#!/usr/bin/env bash
# Builds and installs durable_jobs into the PostgreSQL of PG_CONFIG: what `cargo pgrx install`
# installs (library, control file, the current version's install script, the upgrade and
# downgrade scripts in sql/), plus the kept install scripts of released versions
# (sql/durable_jobs--<version>.sql), which cargo-pgrx leaves out, so that
# CREATE EXTENSION durable_jobs VERSION '<version>' works too.
#   Arguments go on to cargo pgrx install (for instance --release).
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)

install_args=(--pg-config "$PG_CONFIG" "$@")
[ "$(id -u)" -eq 0 ] || install_args+=(--sudo)
cargo pgrx install "${install_args[@]}"

current_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
extension_dir="$("$PG_CONFIG" --sharedir)/extension"
for script in sql/durable_jobs--*.sql; do
    name=$(basename "$script")
    # Upgrade scripts (two versions in the name) are cargo-pgrx's; the current version's
    # install script is the one it just generated.
    case "$name" in *--*--*|"durable_jobs--$current_version.sql") continue ;; esac
    "${as_root[@]}" install -m 644 "$script" "$extension_dir/$name"
    echo "installed released install script $name"
done
