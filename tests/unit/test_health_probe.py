"""The fault suite's ``/health`` probe (serve_app/faults/traffic.py ``HealthProbe``): the engine-kill
scenario ends its timeline only once every router replica's answer is back to 200."""

import asyncio
import itertools

import httpx

from serve_app.faults.traffic import HealthProbe


def _probe_answering(codes) -> tuple[HealthProbe, httpx.AsyncClient]:
    """A probe whose ``/health`` answers each code of ``codes`` in turn (then the last forever)."""
    answers = itertools.chain(codes, itertools.repeat(codes[-1]))

    def health(request: httpx.Request) -> httpx.Response:
        code = next(answers)
        return httpx.Response(code, json={"status": "ok" if code == 200 else "recovering", "states": {}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(health))
    return HealthProbe(client, "http://region.test", period_s=0.01), client


def _until_steady(probe: HealthProbe, client: httpx.AsyncClient, *, in_a_row: int, timeout_s: float) -> bool:
    async def run():
        probe.start()
        steady = await probe.until_steady(200, in_a_row=in_a_row, timeout_s=timeout_s)
        await probe.stop()
        await client.aclose()
        return steady

    return asyncio.run(run())


def test_steady_means_every_answer_of_the_window_agreed():
    # Two routers behind the proxy, one a refresh behind the other: 200 and 503 alternate first.
    probe, client = _probe_answering([503, 200, 503, 200, 503, 200])
    assert _until_steady(probe, client, in_a_row=3, timeout_s=30)
    timeline = probe.changes()
    assert timeline[-1]["code"] == 200 and [entry["code"] for entry in timeline][:2] == [503, 200]
    codes = [code for _, code, *_ in probe.samples]
    after_last_503 = codes[len(codes) - codes[::-1].index(503):]
    assert len(after_last_503) >= 3 and set(after_last_503) == {200}  # not steady on one 200 between 503s


def test_a_region_that_never_settles_is_said_not_steady():
    probe, client = _probe_answering([503])
    assert _until_steady(probe, client, in_a_row=2, timeout_s=0.3) is False
