#!/usr/bin/env bash
# The main job on the embedded default: consume examples/payments.jsonl
# (payments with broker redeliveries, a producer retry with a new message id,
# and one malformed line) exactly once into a SQLite ledger (./idemq.db),
# then show the outcome, the ledger and the dead letter.
# Run it twice: the second run applies nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only the embedded default is compiled here, unoptimised (the `demo` profile:
# quickest to build, and enough for a dozen messages); `cargo build --release
# -p idemq-cli` builds the optimised binary with every backend and broker
# (and takes several minutes more).
cargo build -q --profile demo -p idemq-cli --no-default-features --features sqlite
idemq="${CARGO_TARGET_DIR:-target}/demo/idemq"

set -x
"$idemq" consume examples/payments.jsonl \
  --consumer payments \
  --key json:/payment_id \
  --init-sql 'CREATE TABLE IF NOT EXISTS ledger (payment_id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL)' \
  --apply-sql 'INSERT INTO ledger (payment_id, account, amount) VALUES (:idemq_key, :account, :amount)'
"$idemq" stats
"$idemq" dlq list --consumer payments
{ set +x; } 2>/dev/null
echo "balances (ledger in ./idemq.db):"
python3 - <<'PY'
import sqlite3
db = sqlite3.connect("idemq.db")
for account, balance, n in db.execute(
        "SELECT account, SUM(amount), COUNT(*) FROM ledger GROUP BY account ORDER BY account"):
    print(f"  {account:<6} {balance:>5}  ({n} payments)")
PY
