"""A FAKE peer for fault runs: it tells the registry's tracker it holds every chunk of a version
and answers every range with the right length and wrong bytes (a node with a damaged disk, or a
hostile one). Pullers must drop it and fetch those chunks elsewhere.

    python tests/support/fake_peer.py --registry URL --token-file F --node NAME --host H --port P --version V
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


async def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--registry", "--token-file", "--node", "--host", "--port", "--version"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    token = Path(args.token_file).read_text().strip()
    served = 0

    async def lie(request: web.Request) -> web.Response:
        nonlocal served
        first, last = request.headers.get("range", "bytes=0-0").split("=")[1].split("-")
        n = int(last) - int(first) + 1
        served += n
        return web.Response(status=206, body=b"\x5a" * n, headers={"content-range": f"bytes {first}-{last}/*"})

    app = web.Application()
    app.router.add_get("/v1/versions/{v}/files/{name}", lie)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, int(args.port)).start()
    auth = {"authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http:
        while True:  # keep claiming the whole version, whatever the tracker thinks of it
            try:
                async with http.get(f"{args.registry}/v1/versions/{args.version}", headers=auth) as r:
                    digest = (await r.json())["digest"] if r.status == 200 else None
                if digest:
                    body = {"url": f"http://{args.host}:{args.port}", "versions": {args.version: {"digest": digest}}}
                    async with http.put(f"{args.registry}/v1/holders/{args.node}", json=body, headers=auth) as r:
                        await r.read()
            except aiohttp.ClientError:
                pass
            print(f"fake_peer: served {served} bad bytes", flush=True)
            await asyncio.sleep(0.5)


if __name__ == "__main__":
    asyncio.run(main())
