"""The wire messages across a rolling upgrade: old and new code read each other's pickles."""

import dataclasses
import pickle

import pytest

from serve_app.wire import messages
from serve_app.wire.messages import Call, DirectLine, Generated, Resume, StreamOpen, Trailer

# Each message's fields as released, in order. A rolling upgrade runs routers and replicas of two
# versions side by side, and a message pickles as its values in field order: a new field goes
# last with a default (then add it here), holding builtins or classes released before it (an
# older reader must find the class before it can drop the field); none is removed, renamed or moved.
RELEASED = {
    "Call": ("body", "request_id", "limit_set_by_router", "previous_response_id", "cache_salt", "resume", "session",
             "avoid_replica", "encoded_answers"),
    "Resume": ("token_ids", "received", "ids", "cached_tokens", "created"),
    "Answer": ("status", "body", "trailer", "replica_ms", "encoded"),
    "StreamOpen": ("address", "ticket", "replica_ms", "tls", "local", "node", "line"),
    "Accepted": ("address", "ticket", "replica_ms", "tls", "local", "node", "line"),
    "DirectLine": ("replica", "key", "address", "tls", "local", "node", "capacity"),
    "Refused": ("reason",),
    "Trailer": ("timing", "usage", "finish_reasons", "complete", "error_code", "error_status", "replica", "generated",
                "response", "terminal", "token_ids", "written", "client_gone"),
    "Generated": ("prompt_tokens", "completion_tokens", "cached_tokens"),
    "EngineTiming": ("queue_ms", "prefill_ms", "decode_ms"),
}


def _message_classes():
    return {name: cls for name, cls in vars(messages).items()
            if dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__module__ == messages.__name__}


def test_every_message_is_released_and_only_grows_at_its_end_with_defaults():
    classes = _message_classes()
    assert set(classes) == set(RELEASED), "a new message class: add its fields to RELEASED"
    for name, cls in classes.items():
        now = dataclasses.fields(cls)
        released = RELEASED[name]
        assert tuple(f.name for f in now[:len(released)]) == released, f"{name}: a field was removed or moved"
        for spec in now[len(released):]:
            assert spec.default is not dataclasses.MISSING or spec.default_factory is not dataclasses.MISSING, (
                f"{name}.{spec.name}: a field added after release needs a default")


def _as_written_by(obj, values: list) -> bytes:
    """``obj`` pickled as a process of another version writes it: the same class, these values."""

    class Other:
        def __reduce_ex__(self, protocol):
            return object.__new__, (type(obj),), values  # the class, then its state: as the dataclass pickles

    return pickle.dumps(Other(), protocol=pickle.HIGHEST_PROTOCOL)


def test_an_older_writers_message_reads_with_the_defaults_of_the_fields_it_lacks():
    # An older router's resume (before ``cached_tokens`` and ``created``): a newer replica reads it.
    resume = pickle.loads(_as_written_by(Resume((1, 2)), [(1, 2), {"text": 3}, {}]))
    assert resume == Resume((1, 2), received={"text": 3})
    assert resume.cached_tokens is None and resume.created is None
    # A default factory gives each message its own value.
    bare = pickle.loads(_as_written_by(Resume(()), [()]))
    assert bare.received == {} and bare.received is not pickle.loads(_as_written_by(Resume(()), [()])).received
    # An older replica's trailer (before ``client_gone``) reads as a trailer whose client stayed.
    trailer = Trailer(usage={"prompt_tokens": 3}, generated=Generated(3, 2))
    older = [getattr(trailer, f.name) for f in dataclasses.fields(Trailer)][:-1]
    assert pickle.loads(_as_written_by(trailer, older)) == trailer
    # The call carrying it, from an older router (before ``session`` and ``avoid_replica``).
    call = pickle.loads(_as_written_by(Call({"stream": True}, "r1"), [{"stream": True}, "r1", False, None, None,
                                                                     None]))
    assert call == Call({"stream": True}, "r1") and call.stream


def test_a_newer_writers_message_reads_without_the_fields_it_added():
    written = [("10.0.0.1", 9), "ticket", 1.5, False, None, None, None, "a field of a later version"]
    assert pickle.loads(_as_written_by(StreamOpen(("10.0.0.1", 9), "ticket"), written)) == StreamOpen(
        ("10.0.0.1", 9), "ticket", replica_ms=1.5)


def test_a_field_released_without_a_default_is_never_filled_in():
    with pytest.raises(TypeError, match="key"):
        pickle.loads(_as_written_by(DirectLine("r", "k" * 32, ("h", 1)), ["r"]))


@pytest.mark.parametrize("message", [
    Call({"stream": True}, "r1", resume=Resume((5, 6), created=7), session="s"),
    Trailer(usage={"completion_tokens": 2}, finish_reasons=("stop",), token_ids=(5, 6), client_gone=True),
    DirectLine("replica", "k" * 32, ("127.0.0.1", 4), capacity=8),
])
def test_messages_of_one_version_round_trip(message):
    assert pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)) == message
