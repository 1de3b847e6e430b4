"""A fault-injecting TCP proxy in front of one engine, for the routing bench and tests:
every connection whose first request is `GET /metrics` gets a 500; every other connection is
piped to the engine unchanged (a router scrapes on its own connection, so this breaks only the
scrapes). Standard library only; run as a script:

    python bench/fault_proxy.py LISTEN_PORT UPSTREAM_PORT
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


async def main(listen_port: int, upstream_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        if first.startswith(b"GET /metrics"):
            writer.write(ANSWER_500)
            await writer.drain()
            writer.close()
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
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
