"""A fault-injecting TCP proxy in front of one engine, for the routing bench and tests. A router
scrapes on connections of their own, so the fault is chosen per connection by its first request:

- metrics-500 (default): `GET /metrics` gets a 500; everything else is piped to the engine;
- reset-requests: `GET /metrics` is piped to the engine (the replica looks healthy and idle);
  every other connection is closed before a byte is answered.

Standard library only; run as a script:

    python -m bench.routing.fault_proxy LISTEN_PORT UPSTREAM_PORT [metrics-500|reset-requests]
"""

from __future__ import annotations

import asyncio
import sys

ANSWER_500 = (b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 22\r\n"
              b"connection: close\r\n\r\ninjected metrics fault")


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(listen_port: int, upstream_port: int, mode: str = "metrics-500") -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        scrape = first.startswith(b"GET /metrics")
        if scrape and mode == "metrics-500":
            writer.write(ANSWER_500)
            await writer.drain()
            writer.close()
            return
        if not scrape and mode == "reset-requests":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            writer.close()
            return
        up_writer.write(first)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4]))
