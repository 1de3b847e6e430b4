"""loadgen's `endpoints`: requests spread round robin over the base URLs the function returns at
each request (the whole-loop run feeds it the Service's ready endpoints), and `on_result`."""

from __future__ import annotations

import asyncio

from iterserve.engine.loadgen import LoadSpec, run_load

SSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
       b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n')


async def _sse_server(hits: list[str], name: str):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        hits.append(name)
        writer.write(SSE)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_requests_follow_the_endpoints_of_the_moment():
    async def scenario():
        hits: list[str] = []
        (a, url_a), (b, url_b) = await _sse_server(hits, "a"), await _sse_server(hits, "b")
        current = [url_a, url_b]
        seen = []

        def on_result(result):
            seen.append((result.endpoint, result.ok))
            if len(seen) == 4:
                current.remove(url_b)  # b leaves the endpoints, as a terminating pod does

        async with a, b:
            report = await run_load(LoadSpec(url="http://127.0.0.1:9", rate=50, requests=10, concurrency=1,
                                             model="m", max_tokens=1, endpoints=lambda: current,
                                             on_result=on_result))
        return report, hits, seen

    report, hits, seen = asyncio.run(scenario())
    assert report["completed"] == 10 and report["config"]["requests"] == 10
    assert "endpoints" not in report["config"] and "on_result" not in report["config"]
    assert hits[:4] == ["a", "b", "a", "b"] and "b" not in hits[5:]
    assert all(ok for _, ok in seen) and {e for e, _ in seen[5:]} == {seen[0][0]}
