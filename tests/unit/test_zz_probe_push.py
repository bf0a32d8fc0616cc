"""Probe: vLLM's engine is push-driven (RequestOutputCollector merges deltas while the consumer
is behind); a stream whose client stops reading is billed only what the replica pulled."""
import asyncio
import json
import socket
import time

from auth_support import MODEL
from fake_engine import FakeEngine


class PushEngine(FakeEngine):
    async def _generate(self, prompt, sampling_params, request_id, *, max_tokens, first=1):
        if sampling_params.output_kind.name != "DELTA":
            async for o in super()._generate(prompt, sampling_params, request_id, max_tokens=max_tokens, first=first):
                yield o
            return
        pending, ready, state = [], asyncio.Event(), {"done": False}

        async def produce():  # the engine core: it does not wait for the consumer
            for i in range(max_tokens):
                await asyncio.sleep(self.latency_s)
                self.generated += 1
                pending.append(first + i)
                ready.set()
            state["done"] = True
            ready.set()

        task = asyncio.ensure_future(produce())
        try:
            while True:
                while not pending and not state["done"]:
                    ready.clear()
                    await ready.wait()
                if pending:
                    tokens = pending[:]
                    pending.clear()
                    yield self._output(prompt, tokens)  # merged, as RequestOutputCollector.add(aggregate=True)
                else:
                    break
        finally:
            task.cancel()  # AsyncLLM.abort on GeneratorExit


def test_probe_stalled_reader(router_app):
    import uvicorn
    from serve_app.router import ingress

    engine = PushEngine(tokens=8000, latency_s=0.0002)
    app = router_app(engine=engine)
    app.services.stall_timeout_s = 25.0
    key, _ = app.auth.keys.create_key(owner="alice", tier="standard")
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(ingress.app, log_level="warning", http="httptools", lifespan="off"))
    serving = app.client.portal.start_task_soon(server.serve, [listener])
    client = socket.socket()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.01)
        body = json.dumps({"model": MODEL, "max_tokens": 8000, "stream": True,
                           "messages": [{"role": "user", "content": "go on"}]}).encode()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(listener.getsockname())
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert client.recv(64).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 40
        while engine.generated < 8000 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("engine generated", engine.generated)
        client.close()  # the hostile client leaves once the engine is done
        (row,) = app.recorded()
        print("recorded", {k: row[k] for k in ("status", "prompt_tokens", "completion_tokens")})
        assert row["completion_tokens"] == engine.generated
    finally:
        client.close()
        server.should_exit = True
        serving.result(timeout=10)
