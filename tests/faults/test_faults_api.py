"""Control API over real HTTP: CRUD of toxics, link down/up, metrics, bad input → 4xx."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from faults_helpers import round_trips

from pdx.faults import FaultProxy
from pdx.faults.api import ControlServer
from pdx.faults.client import ControlClient, ControlError


@pytest.fixture
async def controlled(echo_port: int) -> AsyncIterator[tuple[FaultProxy, str]]:
    async with (
        FaultProxy(("127.0.0.1", 0), ("127.0.0.1", echo_port)) as proxy,
        ControlServer(proxy) as control,
    ):
        yield proxy, control.url


async def test_toxic_crud_over_http(controlled: tuple[FaultProxy, str]) -> None:
    proxy, url = controlled
    async with aiohttp.ClientSession() as http:
        body = {"type": "latency", "name": "wan", "latency_ms": 30}
        async with http.post(f"{url}/toxics", json=body) as resp:
            assert resp.status == 201
            assert (await resp.json())["latency_ms"] == 30
        async with http.patch(f"{url}/toxics/wan", json={"latency_ms": 5}) as resp:
            assert resp.status == 200
        assert proxy.get_toxic("wan").latency_ms == 5  # type: ignore[union-attr]
        async with http.get(f"{url}/toxics") as resp:
            assert [t["name"] for t in await resp.json()] == ["wan"]
        async with http.delete(f"{url}/toxics/wan") as resp:
            assert resp.status == 204
        async with http.get(f"{url}/toxics/wan") as resp:
            assert resp.status == 404
    assert proxy.list_toxics() == []


async def test_bad_requests_get_reasons_and_proxy_keeps_running(
    controlled: tuple[FaultProxy, str],
) -> None:
    proxy, url = controlled
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/toxics", data=b"{not json") as resp:
            assert resp.status == 400
            assert "valid JSON" in (await resp.json())["error"]
        async with http.post(f"{url}/toxics", json={"type": "wormhole"}) as resp:
            assert resp.status == 400
            assert "toxic.type" in (await resp.json())["error"]
        async with http.post(f"{url}/toxics", json={"type": "latency", "latency_ms": -1}) as resp:
            assert resp.status == 400
            assert "latency_ms" in (await resp.json())["error"]
        async with http.post(f"{url}/toxics", json={"type": "latency"}) as resp:
            assert resp.status == 201
        async with http.post(f"{url}/toxics", json={"type": "latency"}) as resp:
            assert resp.status == 409
        async with http.post(f"{url}/link/down", json={"duration_s": "soon"}) as resp:
            assert resp.status == 400
        async with http.get(f"{url}/health") as resp:
            assert resp.status == 200
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    assert len(await round_trips(reader, writer, 2)) == 2
    writer.close()


async def test_link_and_metrics_over_http(controlled: tuple[FaultProxy, str]) -> None:
    proxy, url = controlled
    client = ControlClient(url)
    await asyncio.to_thread(client.add_toxic, {"type": "latency", "latency_ms": 1})
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    await round_trips(reader, writer, 3)
    state = await asyncio.to_thread(client.link_down, 5.0)
    assert state == {"link": "down", "mode": "reset"}
    assert (await asyncio.to_thread(client.link_up))["link"] == "up"
    text = await asyncio.to_thread(client.metrics_text)
    labels = 'direction="upstream",toxic="latency_both",type="latency"'
    assert f"pdx_faults_toxic_packets_affected_total{{{labels}}} 3.0" in text
    assert "pdx_faults_link_down_events_total 1.0" in text
    stats = await asyncio.to_thread(client.stats)
    assert stats["link_down_events"] == 1
    with pytest.raises(ControlError, match="existing toxic"):
        await asyncio.to_thread(client.remove_toxic, "nope")
    writer.close()


async def test_each_proxy_owns_its_registry(echo_port: int) -> None:
    async with (
        FaultProxy(("127.0.0.1", 0), ("127.0.0.1", echo_port)) as one,
        FaultProxy(("127.0.0.1", 0), ("127.0.0.1", echo_port)) as two,
    ):
        one.add_toxic({"type": "latency"})
        reader, writer = await asyncio.open_connection("127.0.0.1", one.port)
        await round_trips(reader, writer, 2)
        writer.close()
        assert b"latency_both" in one.metrics_text()
        assert b"latency_both" not in two.metrics_text()
