"""A transfer engine in its own OS process, driven line by line over stdin (cross-process
tests). Publishes its descriptor in the NATS KV bucket given on the command line.

    python -m tests.transfer.peer_process NATS_URL BUCKET ENGINE_ID TRANSPORTS SIZE_BYTES
    stdin:  fill SEED | sha OFFSET LENGTH | write PEER LOCAL_OFF REMOTE_OFF LENGTH | notes N
    stdout: "ready", then one line per command
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

import nats

from shared.logs import configure_logging
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.registry import NatsEndpointRegistry

SECRET = b"test-secret"


async def main(nats_url: str, bucket: str, engine_id: str, transports: str, size: int) -> None:
    client = await nats.connect(nats_url)
    registry = NatsEndpointRegistry(await client.jetstream().key_value(bucket))
    engine = TransferEngine(TransferConfig(engine_id=engine_id, secret=SECRET,
                                           transports=tuple(transports.split(","))), registry)
    await engine.start()
    kv = await engine.allocate("kv", size)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command, *args = line.split()
        match command:
            case "fill":
                kv[:] = random.Random(int(args[0])).randbytes(size)
                print("filled", flush=True)
            case "sha":
                offset, length = int(args[0]), int(args[1])
                print(hashlib.sha256(kv[offset:offset + length]).hexdigest(), flush=True)
            case "write":
                peer, local, remote, length = args[0], *map(int, args[1:])
                result = await engine.write(peer, [("kv", local, "kv", remote, length)])
                print(result.transport, result.num_bytes, flush=True)
            case "notes":
                notes = [(await engine.notifications.get()).payload.decode()
                         for _ in range(int(args[0]))]
                print(" ".join(notes), flush=True)
    await engine.close()
    await client.close()


if __name__ == "__main__":
    configure_logging("warning", "console")
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
