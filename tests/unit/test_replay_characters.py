"""A resumed stream's tail keeps whole characters only (``replay.whole_characters``): on a
byte-level tokenizer an emoji is up to four tokens, and a prompt that ends inside one makes vLLM's
incremental detokenizer send the whole prompt back with the character that completes it."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode  # the byte-level pre-tokenizer's map

from serve_app.engine.replay import whole_characters


@pytest.fixture(scope="module")
def byte_tokens():
    """One token per byte, as a byte-level BPE without merges: every multi-byte character is split."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_a_tail_that_ends_inside_a_character_loses_that_characters_tokens_only(byte_tokens):
    text = "ok 🤖 é"
    ids = tuple(byte_tokens.encode(text).ids)
    assert len(ids) == len(text.encode())  # one token a byte: the emoji is 4, é is 2
    for end in range(len(ids) + 1):
        kept = whole_characters(byte_tokens, ids[:end])
        assert ids[:end][: len(kept)] == kept
        decoded = byte_tokens.decode(list(kept))
        assert not decoded.endswith("\ufffd") and text.encode().startswith(decoded.encode())
        # Only what the partial character took: the longest prefix of whole characters.
        whole = max(i for i in range(end + 1) if not byte_tokens.decode(list(ids[:i])).endswith("\ufffd"))
        assert len(kept) == whole


def test_a_tail_of_whole_characters_is_kept_as_it_is(byte_tokens):
    ids = tuple(byte_tokens.encode("plain text, then 🤖").ids)
    assert whole_characters(byte_tokens, ids) == ids
    assert whole_characters(byte_tokens, ()) == ()


def test_the_dropped_tokens_are_given_back_to_the_limit():
    """The engine generates the partial character's tokens again: the answer may still reach
    the limit the client had left."""
    from serve_app.engine.vllm_engine import _with_room_for
    from serve_app.wire.messages import Call, Resume

    call = Call({"max_completion_tokens": 7}, "r", resume=Resume((1, 2, 3, 4, 5)))
    assert _with_room_for("chat", call, 2).body == {"max_completion_tokens": 9}
    assert _with_room_for("chat", call, 0) is call
    responses = Call({"max_output_tokens": 7}, "r", resume=Resume((1, 2)))
    assert _with_room_for("responses", responses, 1).body == {"max_output_tokens": 8}
    # min_tokens counts them too, never past the limit.
    minimum = Call({"max_tokens": 7, "min_tokens": 6}, "r", resume=Resume((1, 2, 3)))
    assert _with_room_for("completions", minimum, 2).body == {"max_tokens": 9, "min_tokens": 8}


def test_a_tail_ending_in_replacement_characters_loses_them_all(byte_tokens):
    """U+FFFD written by the model (or stray bytes) ends the prompt as a cut character does, and
    vLLM's detokenizer sends the prompt back after it too: every such trailing token goes."""
    ids = tuple(byte_tokens.encode("hi" + "\ufffd" * 5).ids)
    assert whole_characters(byte_tokens, ids) == tuple(byte_tokens.encode("hi").ids)
    lone = byte_tokens.token_to_id(bytes_to_unicode()[0x80])  # a continuation byte with nothing before it
    stray = tuple(byte_tokens.encode("hi").ids) + (lone,) * 5
    assert byte_tokens.decode(list(stray)).endswith("\ufffd")
    assert whole_characters(byte_tokens, stray) == tuple(byte_tokens.encode("hi").ids)

