"""The executor's broadcast queue: every reader gets every message, in order, large ones whole;
the writer waits for its readers and gives up with a clear error when they do not come."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq

from omniserve.executor.broadcast import BroadcastReceiver, BroadcastSender

NUM_READERS = 3


def _read(receiver: BroadcastReceiver, count: int, into: list) -> None:
    into.extend(receiver.recv() for _ in range(count))


def test_every_reader_gets_every_message_in_order(tmp_path):
    context = zmq.Context()
    address = f"ipc://{tmp_path}/calls"
    sender = BroadcastSender(context, address)
    receivers = [BroadcastReceiver(context, address) for _ in range(NUM_READERS)]
    sender.wait_for_readers(NUM_READERS, timeout_s=10)
    big = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB, far above any socket buffer
    messages: list = [("step", i, {"req": [i] * (i % 7)}) for i in range(5000)]
    messages[2500] = ("big", big)
    received: list[list] = [[] for _ in receivers]
    threads = [
        threading.Thread(target=_read, args=(r, len(messages), out))
        for r, out in zip(receivers, received, strict=True)
    ]
    for thread in threads:
        thread.start()
    for message in messages:  # sent faster than read: nothing may be dropped (no HWM)
        sender.send(message)
    for thread in threads:
        thread.join(timeout=60)
    for out in received:
        assert len(out) == len(messages)
        assert out[:2500] == messages[:2500] and out[2501:] == messages[2501:]
        assert out[2500][0] == "big" and torch.equal(out[2500][1], big)
    for socket in (sender, *receivers):
        socket.close()
    context.term()


def test_waiting_for_missing_readers_times_out_or_reports_the_check(tmp_path):
    context = zmq.Context()
    sender = BroadcastSender(context, f"ipc://{tmp_path}/calls")
    reader = BroadcastReceiver(context, f"ipc://{tmp_path}/calls")
    with pytest.raises(TimeoutError, match="Only 1 of 2 broadcast readers"):
        sender.wait_for_readers(2, timeout_s=0.5)

    def reader_died() -> None:
        raise RuntimeError("worker rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        sender.wait_for_readers(2, timeout_s=10, check=reader_died)
    sender.close()
    reader.close()
    context.term()
