"""AWS Lambda Powertools idempotency on Redis, driven outside Lambda.

The peer row of idemq-bench's `peers` section. It reads payment messages
(one JSON object per line, the same payloads the idemq row consumes), runs
each through a function decorated with Powertools' `@idempotent_function`
over its Redis persistence layer, and prints one JSON object with the rate.

The decorated function does the same trivial work as idemq's handler in
the bench: it counts that its payment's effect ran. After the run the
driver checks that every payment's effect ran exactly once and that every
redelivery was answered from Redis instead.

Usage: powertools_bench.py --redis URL --messages FILE --prefix P [--threads N]
(N = 1: sequential; N > 1: a thread pool of N threads).
"""

import argparse
import json
import platform
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

import redis
from aws_lambda_powertools.utilities.idempotency import (
    IdempotencyConfig,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
    RedisCachePersistenceLayer,
)

# The record TTL of idemq's Redis rows in the bench (600 s).
TTL_SECONDS = 600


def main():
    args = argparse.ArgumentParser()
    args.add_argument("--redis", required=True)
    args.add_argument("--messages", required=True)
    args.add_argument("--prefix", required=True)
    args.add_argument("--threads", type=int, default=1)
    opts = args.parse_args()

    # Read the raw lines before the clock starts; decoding is timed, as
    # idemq decodes each payload inside its run.
    with open(opts.messages, "rb") as f:
        lines = [line for line in f.read().splitlines() if line]

    # Powertools 3.x marks RedisCachePersistenceLayer deprecated in favour
    # of CachePersistenceLayer, which is an alias of the same class.
    warnings.simplefilter("ignore", DeprecationWarning)
    # Outside Lambda every call warns that no Lambda context was registered
    # (shown once per process); there is no context to register here.
    warnings.filterwarnings("ignore", message="Couldn't determine the remaining time left")
    # Our own client (the documented "bring your own client" form); redis-py's
    # client is thread-safe, each command takes a pooled connection.
    client = redis.Redis.from_url(opts.redis, decode_responses=True)
    persistence = RedisCachePersistenceLayer(client=client)
    config = IdempotencyConfig(
        event_key_jmespath="payment_id",  # the business key, as idemq's /payment_id
        raise_on_no_idempotency_key=True,  # no key: an error, not a silent run
        expires_after_seconds=TTL_SECONDS,
    )

    effects = {}  # payment_id -> how often its effect ran
    lock = threading.Lock()

    # Outside Lambda there is no context to register: without one the
    # in-progress record has no expiry of its own (a crashed call's key stays
    # locked until the record's TTL), which the bench never exercises.
    @idempotent_function(
        data_keyword_argument="payment",
        persistence_store=persistence,
        config=config,
        key_prefix=f"{opts.prefix}:powertools",
    )
    def apply(payment):
        # The effect: count it (idemq's handler in the bench does nothing).
        with lock:
            effects[payment["payment_id"]] = effects.get(payment["payment_id"], 0) + 1
        return None

    def handle(line):
        apply(payment=json.loads(line))

    started = time.perf_counter()
    if opts.threads <= 1:
        for line in lines:
            handle(line)
    else:
        with ThreadPoolExecutor(max_workers=opts.threads) as pool:
            # list() re-raises the first failure, if any.
            list(pool.map(handle, lines))
    seconds = time.perf_counter() - started

    distinct = len({json.loads(line)["payment_id"] for line in lines})
    json.dump(
        {
            "messages": len(lines),
            "distinct": distinct,
            "effects": sum(effects.values()),
            "effect_keys": len(effects),
            "max_per_key": max(effects.values(), default=0),
            "seconds": seconds,
            "rate": len(lines) / seconds,
            "threads": max(opts.threads, 1),
            "powertools": version("aws-lambda-powertools"),
            "redis_py": version("redis"),
            "python": platform.python_version(),
        },
        sys.stdout,
    )
    print()


if __name__ == "__main__":
    main()
