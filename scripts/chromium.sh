#!/usr/bin/env bash
# Debian's chromium and chromedriver, for the console's browser test
# (crates/idemq-cli/tests/integration/console.rs drives a headless chromium through
# WebDriver). Installed from Debian's packages when missing; idempotent.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
echo "chromium: installing Debian's chromium and chromium-driver (once)"
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO=sudo
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null 2>&1 ||
  { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null; }
command -v chromedriver >/dev/null
