"""The client's exceptions: one base class, and the fields a caller reads."""

from __future__ import annotations

import pytest

import tandem.client as client
from tandem.client.errors import (
    DaemonNotRunning,
    DaemonTimeout,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    TandemError,
)


@pytest.mark.parametrize("cls", [InvalidRequest, DaemonNotRunning, DaemonTimeout, RequestFailed, QueueFull])
def test_every_client_error_is_a_tandem_error_and_exported(cls):
    assert issubclass(cls, TandemError) and issubclass(cls, Exception)
    assert getattr(client, cls.__name__) is cls


def test_request_failed_carries_code_name_message_and_request_id():
    e = RequestFailed(108, "FIM_UNSUPPORTED", "the model has no FIM tokens", "r7")
    assert (e.code, e.name, e.message, e.request_id) == (108, "FIM_UNSUPPORTED", "the model has no FIM tokens", "r7")
    assert str(e) == "FIM_UNSUPPORTED (108): the model has no FIM tokens"
    assert RequestFailed(100, "MALFORMED_MESSAGE", "bad", None).request_id is None


def test_queue_full_carries_the_queue_and_the_daemons_message():
    e = QueueFull("the queue is full (4 waiting); retry later", 4, 4)
    assert (e.queue_length, e.max_queue) == (4, 4)
    assert str(e) == "the queue is full (4 waiting); retry later"
