"""moto's server (the SQS endpoint of the test suite), with a cheaper clock in its SQS model.

moto's SQS model asks whether every message in a queue is visible and not delayed several times for
each message sent or received, and each of those checks builds datetime objects to read the clock:
with a few thousand messages in a FIFO queue a SendMessageBatch takes seconds, and a relay draining
a backlog into it times out. Reading the clock with time.time() gives the same values (seconds since
the epoch, UTC) about thirty times faster.

moto also recounts every message of the queue (visible, delayed, in flight) each time it reads the
queue's attributes, which it does several times for each message sent: sending into a queue that
holds a few thousand messages costs O(messages) per message, and a consumer that falls behind makes
every send slower. The three approximate counts are kept for 100 ms instead (SQS itself documents
them as approximate). FIFO receives keep a message group's order when a receive's connection is
reset (see below). Nothing else is changed. Arguments are moto_server's.

With `SQS_SEND_LOG=<path>` in its environment, every message the endpoint accepts is also recorded
there, one line `<queue name> TAB <MessageDeduplicationId>` per SendMessage or batch entry (FIFO
duplicates included): a FIFO queue drops a re-sent event id before any consumer sees it, so a test
counts sends here to see duplicates the queue hides.
"""
import os
import sys
import threading
import time

import moto.sqs.models as sqs_models
from moto.core import utils


def unix_time(dt=None):
    return time.time() if dt is None else utils.unix_time(dt)


def unix_time_millis(dt=None):
    return time.time() * 1000.0 if dt is None else utils.unix_time_millis(dt)


sqs_models.unix_time = unix_time
sqs_models.unix_time_millis = unix_time_millis

COUNT_TTL_SECONDS = 0.1


def kept_for_a_while(name, count):
    def getter(queue):
        kept = queue.__dict__.setdefault("_kept_counts", {})
        now = time.time()
        hit = kept.get(name)
        if hit is not None and now - hit[0] < COUNT_TTL_SECONDS:
            return hit[1]
        value = count(queue)
        kept[name] = (now, value)
        return value

    return property(getter)


for _name in (
    "approximate_number_of_messages",
    "approximate_number_of_messages_delayed",
    "approximate_number_of_messages_not_visible",
):
    setattr(sqs_models.Queue, _name, kept_for_a_while(_name, getattr(sqs_models.Queue, _name).fget))

SEND_LOG = os.environ.get("SQS_SEND_LOG")
if SEND_LOG:
    _send_lock = threading.Lock()
    _send_message = sqs_models.SQSBackend.send_message

    def send_message_logged(self, queue_name, message_body, *args, **kwargs):
        message = _send_message(self, queue_name, message_body, *args, **kwargs)
        dedup = kwargs.get("deduplication_id")
        if dedup is None and len(args) >= 3:
            dedup = args[2]
        with _send_lock, open(SEND_LOG, "a", encoding="utf-8") as log:
            log.write(f"{queue_name}\t{dedup or ''}\n")
        return message

    sqs_models.SQSBackend.send_message = send_message_logged

# FIFO receives hold a message group while one of its messages is in flight, as SQS does. moto
# snapshots the groups in flight once per call and reads them without a lock, so a receive whose
# connection was reset (its handler goes on and takes messages for a client that is gone) beside the
# client's retried receive could hand out a group's later message first; and when several messages
# of a group became visible again it handed out the last of them first. Receives of one queue now
# run one at a time, each first letting go of the messages whose visibility ran out.
_receive_locks = {}
_receive_locks_lock = threading.Lock()
_receive_message = sqs_models.SQSBackend.receive_message


def receive_message_in_group_order(self, queue_name, *args, **kwargs):
    with _receive_locks_lock:
        lock = _receive_locks.setdefault(queue_name, threading.Lock())
    with lock:
        queue = self.get_queue(queue_name)
        for message in list(queue.pending_messages):
            if message.visible:
                queue.pending_messages.discard(message)
        return _receive_message(self, queue_name, *args, **kwargs)


sqs_models.SQSBackend.receive_message = receive_message_in_group_order

from moto.server import main  # noqa: E402  (after the patch, so the server sees it)

if __name__ == "__main__":
    sys.exit(main())
