"""Model administration over HTTP: LoRA adapters (vLLM's routes) and weight updates (SGLang's).

    GET  /model_state                        weights version, adapters, slots (per replica behind a router)
    POST /v1/load_lora_adapter               {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter             {"lora_name": "sql"}
    POST /update_weights_from_disk           {"model_path": "/ckpt/step-200", "running": "finish"}
    POST /update_weights_from_tensor         {"shm_path": "/dev/shm/weights.safetensors"}
    POST /init_weights_update_group          {"master_address", "master_port", "rank_offset", "world_size",
                                              "group_name", "backend", "timeout_s"}
    POST /update_weights_from_distributed    {"group_name", "names", "dtypes", "shapes"}
    POST /admin/expert_distribution/start    a new recording of tokens per MoE expert (no body)
    POST /admin/expert_distribution/stop     ends it
    GET  /admin/expert_distribution/dump     the recording: what --init-expert-location loads
    POST /{start,stop,dump}_expert_distribution_record   SGLang's names for the three

`running` (the update routes): "finish" (default) lets running requests end on the old weights
while admission pauses; "retract" sends them back to the queue to re-run on the new ones.
Each answers the backend's ModelState as JSON (with the update's report: bytes, load, swap,
pause and flush seconds), but for the expert distribution routes: they answer the recording as
ExpertDump's JSON ({layers, logical_count, forwards, seconds, recording}); behind a router, the
replicas' recordings added up, and each one under `replicas` with its address. Errors use the
gateway's envelope: 400 (bad path, an adapter or checkpoint that does not fit: the old weights
keep serving; an adapter in use; a model without experts, a dump before any start), 404 (unknown
adapter, a backend without model administration), 503 (no backend). Who may call them: the
admin key (services/gateway/auth.py).
"""
from __future__ import annotations

import json

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from protos.radixmesh.v1 import admin_pb2 as apb
from services.common import expert_distribution
from services.gateway.backend import BackendError
from services.gateway.errors import APIError, from_backend, invalid
from services.gateway.state import STATE

model_admin_routes = web.RouteTableDef()

ADMIN_PATHS = ("/model_state", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/init_weights_update_group")
# SGLang's routes of the expert distribution recorder (ours live under /admin/)
EXPERT_ALIASES = ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                  "/dump_expert_distribution_record")
_RUNNING = {"finish": apb.RUNNING_REQUESTS_FINISH, "retract": apb.RUNNING_REQUESTS_RETRACT}


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    return body


def _field(body: dict, name: str, kind: type, default=None):
    value = body.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is None or not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise invalid(f"{name} must be a {kind.__name__}", param=name)
    return value


def _running(body: dict) -> int:
    mode = body.get("running", "finish")
    if mode not in _RUNNING:
        raise invalid(f"running must be one of {sorted(_RUNNING)}, got {mode!r}", param="running")
    return _RUNNING[mode]


async def _admin(request: web.Request, method: str, message) -> apb.ModelState:
    state = request.app[STATE]
    admin = getattr(state.backend, "admin", None)
    if admin is None:
        raise APIError(404, "this backend has no model administration", code="not_found")
    try:
        return await admin(method, message)
    except BackendError as e:
        raise from_backend(e, state.config.retry_after_s) from None


async def _call(request: web.Request, method: str, message) -> web.Response:
    reply = await _admin(request, method, message)
    if method != "GetModelState":
        await request.app[STATE].refresh()  # /v1/models and the served adapters follow at once
    body = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return web.json_response(body)


@model_admin_routes.get("/model_state")
async def model_state(request: web.Request) -> web.Response:
    return await _call(request, "GetModelState", apb.GetModelStateRequest())


@model_admin_routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    return await _call(request, "LoadLoraAdapter", apb.LoadLoraAdapterRequest(
        lora_name=_field(body, "lora_name", str), lora_path=_field(body, "lora_path", str)))


@model_admin_routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    return await _call(request, "UnloadLoraAdapter", apb.UnloadLoraAdapterRequest(
        lora_name=_field(body, "lora_name", str)))


@model_admin_routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _body(request)
    return await _call(request, "UpdateWeightsFromDisk", apb.UpdateWeightsFromDiskRequest(
        model_path=_field(body, "model_path", str), running=_running(body)))


@model_admin_routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = await _body(request)
    return await _call(request, "UpdateWeightsFromTensor", apb.UpdateWeightsFromTensorRequest(
        shm_path=_field(body, "shm_path", str), running=_running(body)))


@model_admin_routes.post("/init_weights_update_group")
async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    return await _call(request, "InitWeightsUpdateGroup", apb.InitWeightsUpdateGroupRequest(
        master_address=_field(body, "master_address", str), master_port=_field(body, "master_port", int),
        rank_offset=_field(body, "rank_offset", int), world_size=_field(body, "world_size", int),
        group_name=_field(body, "group_name", str, "weights"), backend=_field(body, "backend", str, "gloo"),
        timeout_s=float(_field(body, "timeout_s", float, 60.0))))


@model_admin_routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await _body(request)
    names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise invalid("names, dtypes and shapes must be non-empty lists of one length", param="names")
    try:
        tensors = [apb.TensorMeta(name=n, dtype=d, shape=[int(x) for x in s]) for n, d, s in zip(names, dtypes, shapes)]
    except (TypeError, ValueError):
        raise invalid("names and dtypes must be strings, shapes lists of integers", param="shapes") from None
    return await _call(request, "UpdateWeightsFromDistributed", apb.UpdateWeightsFromDistributedRequest(
        group_name=_field(body, "group_name", str, "weights"), tensors=tensors, running=_running(body)))


async def refuse_parameters(request: web.Request) -> None:
    """A route that takes no body, or {}: a body that is not a JSON object, or has any field, is a 400."""
    extra = sorted(await _body(request))
    if extra:
        raise invalid(f"this route takes no parameters, got {extra}", param=extra[0])


async def _expert_distribution(request: web.Request, action: str) -> web.Response:
    if request.method == "POST":
        await refuse_parameters(request)
    reply = await _admin(request, "ExpertDistribution",
                         apb.ExpertDistributionRequest(action=expert_distribution.ACTIONS[action]))
    return web.json_response(distribution_body(reply))


def distribution_body(reply: apb.ModelState) -> dict:
    """ExpertDump's JSON. Behind a router (one ModelState per replica): the replicas' recordings
    added up (a fleet's load, for --init-expert-location), and each under `replicas`."""
    if not reply.replicas:
        return expert_distribution.to_dict(reply.expert_distribution)
    each = [{"address": r.address, **expert_distribution.to_dict(r.expert_distribution)} for r in reply.replicas]
    try:
        total = expert_distribution.merged(each)
    except ValueError as e:
        raise invalid(f"{e}: use each replica's gateway", code="replicas_differ") from None
    return {**total, "replicas": each}


@model_admin_routes.post("/admin/expert_distribution/start")
@model_admin_routes.post(EXPERT_ALIASES[0])
async def start_expert_distribution(request: web.Request) -> web.Response:
    return await _expert_distribution(request, "start")


@model_admin_routes.post("/admin/expert_distribution/stop")
@model_admin_routes.post(EXPERT_ALIASES[1])
async def stop_expert_distribution(request: web.Request) -> web.Response:
    return await _expert_distribution(request, "stop")


@model_admin_routes.get("/admin/expert_distribution/dump")
@model_admin_routes.post(EXPERT_ALIASES[2])
async def dump_expert_distribution(request: web.Request) -> web.Response:
    return await _expert_distribution(request, "dump")
