#!/usr/bin/env bash
# Profiles one CI run: runs `.ci/run` (or the command given after --) with
# every output line time-stamped, every link timed (scripts/cc-linker appends to
# IDEMQ_LINK_LOG) and the test runner's JUnit report kept, then prints
#   - the time of each step (the "ci:" and "test.sh:" lines),
#   - building the test binaries vs running them,
#   - the links: how many, their total and the slowest,
#   - the chaos cells by time,
#   - the 25 slowest tests with their binary.
# Its last output is kept in docs/operations.md ("CI time").
#
#   scripts/ci-profile.sh                  profile .ci/run
#   scripts/ci-profile.sh -- scripts/test.sh   profile another command
#   scripts/ci-profile.sh --report DIR     print the summary of an earlier run
#
# Output and raw data go to CI_PROFILE_DIR (default /tmp/idemq-ci-profile).
set -uo pipefail
cd "$(dirname "$0")/.."
dir="${CI_PROFILE_DIR:-/tmp/idemq-ci-profile}"
report_only=""
cmd=(.ci/run)
while [ $# -gt 0 ]; do
  case "$1" in
    --report) report_only=1; dir="$2"; shift ;;
    --) shift; cmd=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "ci-profile: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

code=0
if [ -z "$report_only" ]; then
  rm -rf "$dir" && mkdir -p "$dir"
  export IDEMQ_LINK_LOG="$dir/links.log"
  : >"$IDEMQ_LINK_LOG"
  "${cmd[@]}" </dev/null 2>&1 |
    perl -MTime::HiRes=time -ne 'BEGIN { $| = 1; $s = time } printf "%8.1f %s", time - $s, $_' |
    tee "$dir/run.log"
  code=${PIPESTATUS[0]}
  junit="${CARGO_TARGET_DIR:-target}/nextest/ci/junit.xml"
  [ -f "$junit" ] && cp "$junit" "$dir/junit.xml"
  echo "exit $code" >"$dir/exit"
fi

python3 - "$dir" <<'PY'
import os, re, sys
import xml.etree.ElementTree as ET
d = sys.argv[1]
run = open(os.path.join(d, "run.log"), errors="replace").read().splitlines()
print(f"\n== ci-profile: {d} ==")
if os.path.exists(os.path.join(d, "exit")):
    print(open(os.path.join(d, "exit")).read().strip())
print("\n-- steps (seconds) --")
for line in run:
    m = re.match(r"\s*[\d.]+ (ci|test\.sh): (.*): (\d+) s \(total (\d+) s\)", line)
    if m:
        print(f"{m.group(3):>6}  {m.group(1)}: {m.group(2)}  (at {m.group(4)} s)")
links = []
lp = os.path.join(d, "links.log")
if os.path.exists(lp):
    for line in open(lp):
        parts = line.split(maxsplit=1)
        if len(parts) == 2:
            links.append((float(parts[0]), parts[1].strip()))
if links:
    total = sum(t for t, _ in links)
    print(f"\n-- links: {len(links)}, {total:.1f} s in all --")
    for t, out in sorted(links, reverse=True)[:8]:
        print(f"{t:8.2f}  {os.path.basename(out)}")
cells = []
for line in run:
    m = re.search(r"chaos: cell (.*): exit (\d+) in (\d+) s", line)
    if m:
        cells.append((int(m.group(3)), m.group(1), m.group(2)))
if cells:
    print(f"\n-- chaos cells: {len(cells)}, {sum(c[0] for c in cells)} s of cell time --")
    for t, cell, code in sorted(cells, reverse=True):
        print(f"{t:6d}  {cell}  exit {code}")
jp = os.path.join(d, "junit.xml")
if os.path.exists(jp):
    tests = []
    root = ET.parse(jp).getroot()
    for suite in root.iter("testsuite"):
        for case in suite.iter("testcase"):
            failed = case.find("failure") is not None or case.find("error") is not None
            tests.append((float(case.get("time", 0)), suite.get("name"), case.get("name"), failed))
    print(f"\n-- tests: {len(tests)}, {sum(t[0] for t in tests):.0f} s of test time; the 25 slowest --")
    for t, binary, name, failed in sorted(tests, reverse=True)[:25]:
        print(f"{t:8.1f}  {binary}  {name}{'  FAILED' if failed else ''}")
    bad = [t for t in tests if t[3]]
    if bad:
        print(f"\n-- failed: {len(bad)} --")
        for t, binary, name, _ in bad:
            print(f"{t:8.1f}  {binary}  {name}")
PY
exit $code
