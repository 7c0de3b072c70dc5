#!/usr/bin/env bash
# Builds durable_jobs and installs it into the PostgreSQL of PG_CONFIG: the library, the control
# file, the current version's install script, the upgrade and downgrade scripts in sql/, and the
# kept install scripts of released versions (sql/durable_jobs--<version>.sql, which cargo-pgrx
# leaves out), so that CREATE EXTENSION durable_jobs VERSION '<version>' works too.
#   install-extension.sh            debug build (what the tests use)
#   install-extension.sh --release  optimized build
# Safe while the server runs: each file is replaced, not rewritten in place, so backends that
# have the old library loaded keep it (cargo pgrx install rewrites it under them).
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
package_args=(--debug)
case "${1:-}" in
    --release) package_args=() ;;
    "") ;;
    *) echo "usage: $0 [--release]" >&2; exit 2 ;;
esac
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo)

package_dir=target/durable_jobs-package
rm -rf "$package_dir"
cargo pgrx package --pg-config "$PG_CONFIG" "${package_args[@]}" --out-dir "$package_dir"

current_version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
extension_dir=$("$PG_CONFIG" --sharedir)/extension
for script in sql/durable_jobs--*.sql; do
    name=$(basename "$script")
    # Upgrade scripts (two versions in the name) are in the package already, and so is the
    # install script of the current version, generated from the code.
    case "$name" in *--*--* | "durable_jobs--$current_version.sql") continue ;; esac
    install -D -m 644 "$script" "$package_dir$extension_dir/$name"
done

# install(1) unlinks the old file before writing the new one.
(cd "$package_dir" && find . -type f) | while read -r file; do
    target=${file#.}
    mode=644
    case "$target" in *.so) mode=755 ;; esac
    "${as_root[@]}" install -D -m "$mode" "$package_dir$target" "$target"
    echo "installed $target"
done
