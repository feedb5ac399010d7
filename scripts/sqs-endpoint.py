"""moto's server (the SQS endpoint of the test suite), with a cheaper clock in its SQS model.

moto's SQS model asks whether every message in a queue is visible and not delayed several times for
each message sent or received, and each of those checks builds datetime objects to read the clock:
with a few thousand messages in a FIFO queue a SendMessageBatch takes seconds, and a relay draining
a backlog into it times out. Reading the clock with time.time() gives the same values (seconds since
the epoch, UTC) about thirty times faster; nothing else is changed. Arguments are moto_server's.
"""
import sys
import time

import moto.sqs.models as sqs_models
from moto.core import utils


def unix_time(dt=None):
    return time.time() if dt is None else utils.unix_time(dt)


def unix_time_millis(dt=None):
    return time.time() * 1000.0 if dt is None else utils.unix_time_millis(dt)


sqs_models.unix_time = unix_time
sqs_models.unix_time_millis = unix_time_millis

from moto.server import main  # noqa: E402  (after the patch, so the server sees it)

if __name__ == "__main__":
    sys.exit(main())
