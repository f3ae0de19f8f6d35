"""moto's server (scripts/sqs.sh starts it), with three hot spots made
cheap; what SQS does is unchanged.

1. Every SendMessage reads the queue's attributes, which counts the visible
   and the delayed messages by asking each message's clock: `unix_time()`
   builds two datetimes and subtracts them per call, so publishing n messages
   costs O(n^2) datetime arithmetic (a profile of moto during the tests: 90 %
   of its samples there; 780 messages took minutes). Here the current time
   is `time.time()`, the same clock, and a given datetime is converted as
   before.
2. A long poll on a FIFO queue whose visible messages all belong to groups
   in flight re-scans the queue at once, again and again, until its wait
   ends (the condition it waits on is "some message is visible"). Here it
   waits for a new message or 50 ms between scans.
3. Every request lists moto's package directory (a directory read and
   ~150 stats) to tell a service name from a host name: a third of its
   samples in the tests. Here the list is read once.

Usage: python3 scripts/moto-server.py [moto_server's arguments]
"""

import sys
import time

import moto.core.utils as utils

_unix_time = utils.unix_time


def unix_time(dt=None):
    """Seconds since the epoch, now or at `dt`, as moto's."""
    return time.time() if dt is None else _unix_time(dt)


def unix_time_millis(dt=None):
    """Milliseconds since the epoch, now or at `dt`, as moto's."""
    return unix_time(dt) * 1000.0


# Before moto's SQS model imports them by name.
utils.unix_time = unix_time
utils.unix_time_millis = unix_time_millis

from moto.sqs import models  # noqa: E402

models.unix_time = unix_time
models.unix_time_millis = unix_time_millis


def wait_for_messages(self, timeout):
    """moto's wait, except when visible messages are already there (none
    of which the caller could take): then a new message or 50 ms."""
    with self._messages_lock:
        if self.messages:
            self._messages_lock.wait(timeout=min(timeout, 0.05))
        else:
            self._messages_lock.wait_for(lambda: self.messages, timeout=timeout)


models.Queue.wait_for_messages = wait_for_messages

import moto.backends as backends  # noqa: E402

_modules = tuple(backends.list_of_moto_modules())
backends.list_of_moto_modules = lambda: _modules

from moto.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
