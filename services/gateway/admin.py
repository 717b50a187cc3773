"""`/admin` on the gateway: the router's replica management over HTTP.

    GET    /admin/replicas                       the policy and every replica's state, load, counters
    POST   /admin/replicas        {"address": "HOST:PORT"}       add one (201)
    POST   /admin/replicas/{address}/drain       stop new work there; in-flight requests finish
    POST   /admin/replicas/{address}/resume      undo a drain
    DELETE /admin/replicas/{address}[?force=true&timeout_s=N]    drain then forget (force: at once)

The gateway's --tokenizer-addr must be a router (it serves radixmesh.v1.Router beside the
Tokenizer surface); against a single replica these routes answer 404. Errors use the
gateway's envelope (400 bad address or not a working replica, with the router's reason; 404 unknown
replica; 409 already added; 503 router down).
Who may call them: the admin key (--admin-api-key); a user key gets 403 (services/gateway/auth.py).
"""
from __future__ import annotations

import json

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from protos.radixmesh.v1 import router_pb2, router_pb2_grpc
from services.common import tls
from services.gateway.errors import APIError
from services.gateway.state import STATE

admin_routes = web.RouteTableDef()

# FAILED_PRECONDITION: AddReplica's health probe of the new address failed (dead, not SERVING,
# a certificate the fleet does not trust): the caller gave a bad address, the router is fine.
_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
         grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.UNIMPLEMENTED: 404}


async def _call(request: web.Request, method: str, message, status: int = 200,
                changes: bool = True) -> web.Response:
    """One Router RPC; after one that `changes` the fleet, readiness is checked again at once
    (draining the last routable replica makes /ready 503 now, not at the next poll)."""
    state = request.app[STATE]
    address = state.config.tokenizer_addr
    try:
        async with tls.aio_channel(address) as channel:
            reply = await getattr(router_pb2_grpc.RouterStub(channel), method)(message, timeout=120)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        detail = (f"the gateway's backend at {address} is not a router" if code == grpc.StatusCode.UNIMPLEMENTED
                  else e.details() or code.name)
        http = _HTTP.get(code, 503)
        raise APIError(http, detail, "invalid_request_error" if http < 500 else "service_unavailable_error",
                       code=code.name.lower()) from None
    if changes:
        await state.refresh()
    body = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return web.json_response(body, status=status)


@admin_routes.get("/admin/replicas")
async def list_replicas(request: web.Request) -> web.Response:
    return await _call(request, "ListReplicas", router_pb2.ListReplicasRequest(), changes=False)


@admin_routes.post("/admin/replicas")
async def add_replica(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read() or b"{}")
        address = body["address"]
    except (ValueError, KeyError, TypeError):
        raise APIError(400, 'send {"address": "HOST:PORT"}', param="address") from None
    if not isinstance(address, str):
        raise APIError(400, "address must be a string", param="address")
    return await _call(request, "AddReplica", router_pb2.AddReplicaRequest(address=address), 201)


@admin_routes.post("/admin/replicas/{address}/drain")
async def drain_replica(request: web.Request) -> web.Response:
    return await _call(request, "DrainReplica", router_pb2.DrainReplicaRequest(address=request.match_info["address"]))


@admin_routes.post("/admin/replicas/{address}/resume")
async def resume_replica(request: web.Request) -> web.Response:
    return await _call(request, "DrainReplica", router_pb2.DrainReplicaRequest(
        address=request.match_info["address"], resume=True))


@admin_routes.delete("/admin/replicas/{address}")
async def remove_replica(request: web.Request) -> web.Response:
    try:
        timeout_s = float(request.query.get("timeout_s", 0))
    except ValueError:
        raise APIError(400, "timeout_s must be a number", param="timeout_s") from None
    force = request.query.get("force", "false").lower() in ("1", "true", "yes")
    return await _call(request, "RemoveReplica", router_pb2.RemoveReplicaRequest(
        address=request.match_info["address"], force=force, timeout_s=timeout_s))
