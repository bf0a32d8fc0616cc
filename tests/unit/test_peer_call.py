"""A peer region's continuation of a stream (``router/peer_call.py``), read from a real
``httpx`` response: its chunks relayed whole, its ending turned into the call's trailer."""

import asyncio
import json

import httpx

from serve_app.router.peer_call import PEER_STREAM_FAILED, PeerCall
from serve_app.surfaces.dialects import pg_metadata_event
from serve_app.wire.sse import DONE, data_event


def _chunk(text, finish=None):
    return data_event({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


CLOSING = pg_metadata_event(
    {"region": "yvr-01", "replica": "yvr-replica-1", "queue_ms": 1.5, "inference_ttft_ms": 4.0,
     "inference_total_ms": 10.0},
    chunk_id="chatcmpl-1", usage={"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17},
) + DONE


class Chunks(httpx.AsyncByteStream):
    def __init__(self, parts, breaks=False):
        self.parts, self.breaks, self.closed = parts, breaks, False

    async def __aiter__(self):
        for part in self.parts:
            yield part
        if self.breaks:
            raise httpx.ReadError("peer gone")

    async def aclose(self):
        self.closed = True


def _read_all(call):
    async def run():
        out = b""
        while data := await call.read(65536):
            out += data
        return out, await call.trailer()

    return asyncio.run(run())


def test_chunks_pass_whole_and_the_peers_ending_becomes_the_trailer():
    # The peer's router sends a keep-alive comment while its engine is silent: not relayed.
    stream = (": keep-alive\n\n" + _chunk("t6 ") + ": keep-alive\n\n" + _chunk("t7 ", "length") + CLOSING).encode()
    parts = [stream[i:i + 7] for i in range(0, len(stream), 7)]  # events split anywhere
    body = Chunks(parts)
    call = PeerCall("yvr-01", httpx.Response(200, stream=body), tokens_before=5)
    relayed, trailer = _read_all(call)
    assert relayed == (_chunk("t6 ") + _chunk("t7 ", "length")).encode()  # no pg_metadata, no [DONE]
    assert trailer.complete and trailer.finish_reasons == ("length",) and trailer.replica == "yvr-replica-1"
    assert trailer.usage["completion_tokens"] == 12
    # Its engine prefilled the prompt and the 5 tokens before the seam, and generated 7.
    assert (trailer.generated.prompt_tokens, trailer.generated.completion_tokens) == (10, 7)
    assert (trailer.timing.queue_ms, trailer.timing.prefill_ms, trailer.timing.decode_ms) == (1.5, 4.0, 6.0)
    assert body.closed and not call.under_way


def test_a_peer_stream_that_breaks_or_errs_is_incomplete_and_billed_its_relayed_chunks():
    broken = PeerCall("yvr-01", httpx.Response(200, stream=Chunks([_chunk("t6 ").encode()], breaks=True)),
                      tokens_before=5)
    relayed, trailer = _read_all(broken)
    assert relayed == _chunk("t6 ").encode()
    assert (trailer.complete, trailer.error_code, trailer.generated.completion_tokens) == (False, PEER_STREAM_FAILED, 1)
    error = data_event({"error": {"code": "engine_unavailable", "message": "x"}}) + DONE
    erred = PeerCall("yvr-01", httpx.Response(200, stream=Chunks([(_chunk("t6 ") + _chunk("t7 ") + error).encode()])),
                     tokens_before=5)
    relayed, trailer = _read_all(erred)
    assert b'"error"' not in relayed  # this router ends the stream with its own error event
    assert (trailer.complete, trailer.error_code, trailer.generated.completion_tokens) == (False, "engine_unavailable", 2)


def test_a_client_leaving_closes_the_peer_connection():
    body = Chunks([_chunk("t6 ").encode()])
    call = PeerCall("yvr-01", httpx.Response(200, stream=body), tokens_before=5)

    async def leave():
        await call.read(65536)
        assert call.under_way
        call.hang_up()
        return await call.last()

    trailer = asyncio.run(leave())
    assert body.closed and not trailer.complete and trailer.generated.completion_tokens == 1


def test_a_client_leaving_after_the_peer_stream_broke_but_before_its_trailer_still_closes_the_peer():
    """The relay read the stream's end, a broken one (the call has ended; httpx closes a response
    read to its end itself, not one whose read failed), and the client left before the relay's
    ``trailer`` closed the connection: the relay's own hang-up closes it."""
    body = Chunks([_chunk("t6 ").encode()], breaks=True)
    call = PeerCall("yvr-01", httpx.Response(200, stream=body), tokens_before=5)

    async def leave():
        while await call.read(65536):
            pass
        assert not call.under_way  # nothing left to bill from the peer
        call.hang_up()
        await asyncio.sleep(0)  # the close runs as its own task
        await asyncio.sleep(0)

    asyncio.run(leave())
    assert body.closed
