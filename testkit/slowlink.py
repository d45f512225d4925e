"""A TCP relay that makes a slow, lossy link where ``tc netem`` is unavailable (a kernel
without sch_netem): every chunk waits ``delay_ms`` each way, and a ``loss`` fraction of
chunks waits a further ``retransmit_ms``, as a lost segment does when TCP resends it.
Order is kept (TCP would keep it too). Run inside a host's namespace:

    python -m testkit.slowlink 127.0.0.1:6380 10.231.13.1:6379 --delay-ms 50 --loss 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, loss: float,
    retransmit: float,
) -> None:  # fmt: skip
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(chunk)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    last_due = 0.0
    try:
        while chunk := await reader.read(65536):
            extra = retransmit if random.random() < loss else 0.0  # noqa: S311 - simulated loss
            last_due = max(last_due, time.monotonic() + delay + extra)  # keep the order
            queue.put_nowait((last_due, chunk))
    finally:
        queue.put_nowait((0.0, b""))
        await sender


async def serve(listen: str, target: str, delay: float, loss: float, retransmit: float) -> None:
    to_host, to_port = target.rsplit(":", 1)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(to_host, int(to_port))
        await asyncio.gather(
            _pump(reader, up_writer, delay, loss, retransmit),
            _pump(up_reader, writer, delay, loss, retransmit),
            return_exceptions=True,
        )

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(relay, host, int(port))
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("listen")
    parser.add_argument("target")
    parser.add_argument("--delay-ms", type=float, default=50)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--retransmit-ms", type=float, default=200)
    args = parser.parse_args()
    delay, retransmit = args.delay_ms / 1000, args.retransmit_ms / 1000
    asyncio.run(serve(args.listen, args.target, delay, args.loss, retransmit))


if __name__ == "__main__":
    main()
