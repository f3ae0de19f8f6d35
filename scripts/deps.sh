#!/usr/bin/env bash
# What the build and the test runner need, installed when missing
# (idempotent):
# - from Debian's packages: cmake, the libcurl and OpenSSL headers and
#   pkg-config for the statically built librdkafka (feature `kafka`, with
#   TLS and SASL), and mold, the linker scripts/cc-linker uses when present
#   (several times faster on the test binaries; optional for a build);
# - from crates.io: cargo-nextest, which scripts/test.sh runs the tests
#   with (built once into ~/.cargo/bin; pinned below). Built unoptimised,
#   without debug info (217 s on 2 cores against 511 s for a release build;
#   a test runner spends its time waiting for the tests) and without its
#   default features (`self-update`: an HTTP and TLS stack to download new
#   versions of itself; `usdt`: DTrace probes), which the tests use neither.
set -euo pipefail
NEXTEST_VERSION=0.9.151
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || missing+=(libcurl4-openssl-dev)
dpkg -s libssl-dev >/dev/null 2>&1 || missing+=(libssl-dev)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v mold >/dev/null 2>&1 || missing+=(mold)
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO=sudo
  $SUDO apt-get install -y "${missing[@]}" >/dev/null 2>&1 ||
    { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y "${missing[@]}"; }
fi
if [[ "${1:-}" == --nextest ]] &&
  ! cargo nextest --version 2>/dev/null | grep -q "cargo-nextest $NEXTEST_VERSION"; then
  echo "deps: installing cargo-nextest $NEXTEST_VERSION from crates.io (once)"
  # Built as itself, not linted: .ci/run's clippy wrapper is for this
  # workspace only.
  env -u RUSTC_WORKSPACE_WRAPPER -u CLIPPY_ARGS CARGO_PROFILE_DEV_DEBUG=false \
    cargo install --debug --locked --quiet \
    --no-default-features cargo-nextest --version "$NEXTEST_VERSION"
fi
