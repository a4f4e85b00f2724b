"""The control protocol's wire format (swiftrun.protocol.control): encode/decode and what counts as malformed."""

from __future__ import annotations

import json

import pytest

from swiftrun.errors import ProtocolError
from swiftrun.protocol.control import (
    PROTOCOL_VERSION,
    Ack,
    Command,
    CommandKind,
    Event,
    EventKind,
    Heartbeat,
    Hello,
    Message,
    Ping,
    Pong,
    MsgKind,
    Status,
    Welcome,
    decode,
    encode,
)

EXAMPLES: list[Message] = [
    Hello(gen=0, token="s3cret", rank=3, incarnation=2, pid=4242),
    Hello(gen=1, token="s3cret", rank=-1, pid=99, spare=True),
    Welcome(gen=2, heartbeat_interval=0.25, heartbeat_timeout=7.5),
    Heartbeat(gen=1, step=17),
    Status(gen=1, step=18, loss=2.5, step_time=0.125, metrics={"tokens_per_s": 1234.5, "lr": 3e-4}),
    Status(gen=0),
    Event(gen=3, event=EventKind.RECOVERED, data={"phases": {"transfer": 0.2}, "plan": {"source": 0}}),
    Event(gen=0, event=EventKind.FAILED, data={"traceback": "Traceback (most recent call last):\n  ...\n"}),
    Command(gen=2, cmd_id=11, command=CommandKind.RECOVER, args={"world_size": 4, "replaced": [1, 3]}),
    Command(gen=0, cmd_id=0, command=CommandKind.ASSIGN, args={"env": {"RANK": "1"}, "rank": 1}),
    Ack(gen=2, cmd_id=11),
    Ping(gen=1, seq=3),
    Pong(gen=1, seq=3),
]


def frames(kind: str, payload: object) -> list[bytes]:
    return [kind.encode(), json.dumps(payload).encode()]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_encode_then_decode_gives_back_an_equal_message(msg):
    out = encode(msg)

    assert len(out) == 2 and out[0] == msg.kind.value.encode()
    assert decode(out) == msg
    assert type(decode(out)) is type(msg)


def test_every_message_kind_has_a_round_trip_example():
    assert {m.kind for m in EXAMPLES} == set(MsgKind)


@pytest.mark.parametrize("kind", list(EventKind))
def test_every_event_kind_round_trips_as_an_enum(kind):
    decoded = decode(encode(Event(gen=1, event=kind)))
    assert decoded.event is kind


@pytest.mark.parametrize("kind", list(CommandKind))
def test_every_command_kind_round_trips_as_an_enum(kind):
    decoded = decode(encode(Command(gen=1, cmd_id=5, command=kind)))
    assert decoded.command is kind


def test_the_payload_is_json_with_enum_values_and_no_class_variables():
    kind, payload = encode(Command(gen=1, cmd_id=2, command=CommandKind.ABORT))

    assert kind == b"COMMAND"
    assert json.loads(payload) == {"gen": 1, "cmd_id": 2, "command": "ABORT", "args": {}}


def test_tuples_and_sets_in_args_are_sent_as_lists():
    _, payload = encode(Command(gen=1, command=CommandKind.RECOVER, args={"replaced": (1, 2), "set": frozenset([3])}))
    assert json.loads(payload)["args"] == {"replaced": [1, 2], "set": [3]}


def test_a_value_json_cannot_carry_is_refused_at_encode_time():
    with pytest.raises(TypeError):
        encode(Event(event=EventKind.RECOVERED, data={"when": object()}))


def test_missing_fields_take_their_defaults():
    msg = decode([b"HELLO", b"{}"])
    assert msg == Hello(gen=0, proto=PROTOCOL_VERSION, token="", rank=-1, incarnation=0, pid=0, spare=False)


def test_unknown_fields_are_ignored():
    msg = decode(frames("HEARTBEAT", {"gen": 4, "step": 9, "from_the_future": True}))
    assert msg == Heartbeat(gen=4, step=9)


def test_a_kind_field_in_the_payload_does_not_change_the_message_type():
    msg = decode(frames("ACK", {"gen": 1, "cmd_id": 3, "kind": "HELLO"}))
    assert msg == Ack(gen=1, cmd_id=3)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([], id="no-frames"),
        pytest.param([b"HEARTBEAT"], id="one-frame"),
        pytest.param([b"identity", b"HEARTBEAT", b"{}"], id="routing-id-not-stripped"),
        pytest.param([b"HEARTBEAT", b"{}", b"{}"], id="three-frames"),
        pytest.param([b"GOODBYE", b"{}"], id="unknown-kind"),
        pytest.param([b"heartbeat", b"{}"], id="kind-is-case-sensitive"),
        pytest.param([b"\xff\xfe", b"{}"], id="kind-not-utf8"),
        pytest.param([b"HEARTBEAT", b"{not json"], id="bad-json"),
        pytest.param([b"HEARTBEAT", b""], id="empty-payload"),
        pytest.param([b"HEARTBEAT", b"\xff\xfe\xfd"], id="payload-not-utf8"),
        pytest.param([b"HEARTBEAT", b"[1, 2]"], id="payload-is-a-list"),
        pytest.param([b"HEARTBEAT", b"3"], id="payload-is-a-number"),
        pytest.param([b"HEARTBEAT", b"null"], id="payload-is-null"),
        pytest.param([b"EVENT", b'{"event": "EXPLODED"}'], id="unknown-event-kind"),
        pytest.param([b"COMMAND", b'{"command": "REBOOT"}'], id="unknown-command-kind"),
        pytest.param([b"COMMAND", b'{"command": null}'], id="command-is-null"),
    ],
)
def test_malformed_frames_raise_protocol_error(bad):
    with pytest.raises(ProtocolError):
        decode(bad)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([b"EVENT", b'{"gen": "one", "event": "ABORTED"}'], id="gen-is-a-string"),
        pytest.param([b"EVENT", b'{"gen": 1, "event": "RECOVERED", "data": [1, 2]}'], id="data-is-a-list"),
        pytest.param([b"STATUS", b'{"gen": 1, "step": 3, "metrics": "fast"}'], id="metrics-is-a-string"),
        pytest.param([b"HEARTBEAT", b'{"gen": 1, "step": [3]}'], id="step-is-a-list"),
    ],
)
def test_fields_of_the_wrong_type_raise_protocol_error(bad):
    with pytest.raises(ProtocolError):
        decode(bad)
