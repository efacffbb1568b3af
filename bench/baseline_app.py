"""Baseline apps for the heartbeat benchmark: what the same PUT costs with no registry behind it.

``asgi``     bare ASGI: read the body, answer a fixed small JSON (the framework ceiling).
``fastapi``  the same answer from a FastAPI route with the registry's path parameter and raw
             body read, but no guard, no validation, no store and no metrics.

Served by uvicorn's own CLI with uvloop and httptools, e.g.::

    python -m uvicorn baseline_app:asgi --app-dir bench --loop uvloop --http httptools
"""

from fastapi import FastAPI, Path, Request
from fastapi.responses import Response

REPLY = b'{"instance":"0123456789abcdef","latest":3,"demand":{"min_version":null}}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]


async def asgi(scope, receive, send):
    if scope["type"] != "http":  # lifespan: nothing to set up
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    # Two messages, like a Starlette response: headers, then body.
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": REPLY})


fastapi = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@fastapi.put("/v1/replicas/{replica_id}")
async def heartbeat(request: Request, replica_id: str = Path(max_length=128)):
    await request.body()
    return Response(REPLY, media_type="application/json")


@fastapi.get("/healthz")
async def healthz():
    return Response(REPLY, media_type="application/json")
