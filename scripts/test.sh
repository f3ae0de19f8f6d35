#!/usr/bin/env bash
# The whole test suite: unit tests, doctests, and the integration tests
# against real PostgreSQL, MariaDB and SQLite. Run from anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
cargo test --workspace --all-features "$@"
