"""The gateway's HTTP application: routes, handlers and middlewares.

A generation request goes: read the body within its limits (`limits.read_body`) → parse (pydantic,
strict) → prepare (template, tokenize, check; one `GenerateRequest` per choice) → submit every choice
to the mesh → collect the events into one response, or stream them as SSE chunks. A small body
without a grammar is parsed and prepared on the event loop, where the hand-off to a thread would cost
more than the work; a larger one, or one that builds a grammar, goes to a thread pool, so that a long
prompt delays no other request.
Middlewares, outermost first: `observe` (stats, metrics, one log line per request), `openai_errors`
(every failure as OpenAI's error body), `authenticate`, `limit_concurrency` (per API key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from services.gateway.backend import MeshBackend
from services.gateway.errors import APIError
from services.gateway.fanout import FanOut
from services.gateway.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    KeyConcurrency,
    body_too_large,
    default_max_body_bytes,
    read_body,
)
from services.gateway.metrics import GatewayMetrics, RequestStats, request_log
from services.gateway.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    HealthStatus,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from services.gateway.openapi import OPERATIONS, openapi_document
from services.gateway.prepare import (
    Job,
    ServedModel,
    chat_job,
    check_model,
    completion_job,
    detokenize,
    tokenize,
)
from services.gateway.render import ChoiceState, Renderer, TokenText
from services.gateway.streaming import EventStream
from shared import trace
from shared.protocol import TokenEvent

logger = logging.getLogger(__name__)

INLINE_PREPARE_BYTES = 4096
"""A body this small tokenizes in well under a millisecond: less than handing it to a thread costs."""
POOLED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "tools")
"""Fields that make preparing build a grammar (xgrammar), whose cost no body size bounds."""
HEALTH_TTL_S = 1.0
"""How long a health answer is reused when admitting requests."""
CLIENT_CLOSED = 499
"""Status recorded (never sent) when the client went away mid-request, as nginx logs it."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT")


@dataclass(frozen=True)
class GatewaySettings:
    api_keys: frozenset[str] = frozenset()
    """Accepted `Authorization: Bearer` keys on /v1/*; empty: no auth."""
    health_ttl_s: float = HEALTH_TTL_S
    max_body_bytes: int = 0
    """Largest request body; 0: room for one prompt of the whole context (`default_max_body_bytes`)."""
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """A body not received this long after its headers gets 408 and its connection closed."""
    max_concurrent_per_key: int = 0
    """Generation requests one API key may have in flight (without keys: all clients together);
    0: no limit."""
    prepare_threads: int = 4
    """Threads that parse, render and tokenize the requests not prepared on the event loop."""
    inline_prepare_bytes: int = INLINE_PREPARE_BYTES
    """Bodies up to this size, asking for no grammar, are prepared on the event loop, not the
    prepare pool; 0: every body goes to the pool."""


class HealthGate:
    """Refuses new requests fast (503) while the mesh has no live worker, asking at most every ttl."""

    def __init__(self, backend: MeshBackend, ttl_s: float):
        self.backend = backend
        self.ttl_s = ttl_s
        self._answer: tuple[bool, str] = (False, "not checked yet")
        self._checked_at = float("-inf")
        self._lock = asyncio.Lock()

    async def check(self) -> None:
        if time.monotonic() - self._checked_at > self.ttl_s:
            async with self._lock:
                if time.monotonic() - self._checked_at > self.ttl_s:
                    self._answer = await self.backend.health()
                    self._checked_at = time.monotonic()
        ok, reason = self._answer
        if not ok:
            raise APIError(503, f"no worker can take the request: {reason}")


SERVED = web.AppKey("served", ServedModel)
BACKEND: web.AppKey[MeshBackend] = web.AppKey("backend")
SETTINGS = web.AppKey("settings", GatewaySettings)
METRICS = web.AppKey("metrics", GatewayMetrics)
HEALTH_GATE = web.AppKey("health_gate", HealthGate)
TOKEN_TEXT = web.AppKey("token_text", TokenText)
CONCURRENCY = web.AppKey("concurrency", KeyConcurrency)
PREPARE_POOL = web.AppKey("prepare_pool", ThreadPoolExecutor)
OPENAPI_JSON = web.AppKey("openapi_json", bytes)
"""/openapi.json, encoded once."""
STATS = web.RequestKey("stats", RequestStats)
API_KEY = web.RequestKey("api_key", str)


def create_app(
    served: ServedModel,
    backend: MeshBackend,
    settings: GatewaySettings | None = None,
    metrics: GatewayMetrics | None = None,
) -> web.Application:
    settings = settings or GatewaySettings()
    app = web.Application(
        middlewares=[observe, openai_errors, authenticate, limit_concurrency],
        client_max_size=settings.max_body_bytes or default_max_body_bytes(served.max_model_len),
    )
    app[SERVED] = served
    app[BACKEND] = backend
    app[SETTINGS] = settings
    app[METRICS] = metrics or GatewayMetrics()
    app[HEALTH_GATE] = HealthGate(backend, settings.health_ttl_s)
    app[TOKEN_TEXT] = TokenText(served.tokenizer)
    app[CONCURRENCY] = KeyConcurrency(settings.max_concurrent_per_key)
    app.cleanup_ctx.append(backend_ctx)
    app.cleanup_ctx.append(prepare_pool_ctx)
    for operation in OPERATIONS:
        handler = HANDLERS[operation.operation_id]
        app.router.add_route(operation.method, operation.path, handler)
        if operation.method == "GET":
            app.router.add_route("HEAD", operation.path, handler)
    document = openapi_document(OPERATIONS, model_name=served.name, api_keys_required=bool(settings.api_keys))
    app[OPENAPI_JSON] = json.dumps(document).encode()
    return app


async def backend_ctx(app: web.Application) -> AsyncIterator[None]:
    """The mesh connection lives as long as the app; closed after in-flight requests ended."""
    backend = app[BACKEND]
    await backend.start()
    yield
    await backend.close()


async def prepare_pool_ctx(app: web.Application) -> AsyncIterator[None]:
    app[PREPARE_POOL] = ThreadPoolExecutor(app[SETTINGS].prepare_threads, thread_name_prefix="prepare")
    yield
    app[PREPARE_POOL].shutdown(wait=False, cancel_futures=True)


# ---- middlewares -----------------------------------------------------------------------------------------


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    endpoint = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    )
    stats = request[STATS] = RequestStats(endpoint)
    try:
        response = await handler(request)
        stats.status = stats.status or response.status  # a stream's own outcome wins over its 200
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        stats.status = CLIENT_CLOSED
        raise
    finally:
        stats.status = stats.status or 500
        stats.finished_at = time.perf_counter()
        request.app[METRICS].observe(stats)
        if stats.request_id is not None:
            request_log.info(
                "%s %s %d", stats.request_id, stats.endpoint, stats.status, extra=stats.log_fields()
            )


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(request, exc), exc.headers.get("Allow"))
    except ConnectionResetError:  # the client is gone: nobody to answer
        raise
    except Exception:
        stats = request[STATS]
        logger.exception(
            "internal error serving %s %s (request %s)", request.method, request.path, stats.request_id
        )
        return error_response(
            APIError(500, f"internal error (request {stats.request_id or '-'}); see the gateway log")
        )


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    keys = request.app[SETTINGS].api_keys
    if keys and request.path.startswith("/v1/"):
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401, "missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
            )
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in keys):
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        request[API_KEY] = key.strip()
    return await handler(request)


@web.middleware
async def limit_concurrency(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    with request.app[CONCURRENCY].hold(request.get(API_KEY, "")):
        return await handler(request)


def error_response(error: APIError, allow: str | None = None) -> web.Response:
    headers = dict(error.headers)
    if allow:
        headers["Allow"] = allow
    response = _json(error.body(), error.status)
    response.headers.update(headers)
    if error.close_connection:
        response.force_close()
    return response


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> APIError:
    if isinstance(exc, web.HTTPNotFound):
        return APIError(404, f"no such route: {request.method} {request.path}", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return APIError(
            405,
            f"{request.method} is not allowed on {request.path} (allowed: {allowed})",
            code="method_not_allowed",
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return body_too_large(request.client_max_size, "read by aiohttp")
    return APIError(exc.status, exc.reason)


# ---- generation ------------------------------------------------------------------------------------------


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await _generate(request, await _prepared(request, CompletionRequest, completion_job))


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await _generate(request, await _prepared(request, ChatCompletionRequest, chat_job))


async def _prepared(
    request: web.Request, model: type[RequestT], prepare: Callable[[RequestT, ServedModel], ResultT]
) -> ResultT:
    """Reads the body within its limits, then parses and prepares it: small ones on the event loop,
    large ones or ones with a grammar on the prepare pool."""
    app = request.app
    raw = await read_body(request, request.client_max_size, app[SETTINGS].body_timeout_s)
    loop = asyncio.get_running_loop()
    if len(raw) > app[SETTINGS].inline_prepare_bytes:
        return await loop.run_in_executor(
            app[PREPARE_POOL], _parse_and_prepare, raw, model, prepare, app[SERVED]
        )
    body = _parse(raw, model)
    if _builds_grammar(body):
        return await loop.run_in_executor(app[PREPARE_POOL], prepare, body, app[SERVED])
    return prepare(body, app[SERVED])


def _parse_and_prepare(
    raw: bytes,
    model: type[RequestT],
    prepare: Callable[[RequestT, ServedModel], ResultT],
    served: ServedModel,
) -> ResultT:
    return prepare(_parse(raw, model), served)


def _parse(raw: bytes, model: type[RequestT]) -> RequestT:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise APIError.from_validation(exc) from None


def _builds_grammar(body: BaseModel) -> bool:
    return any(getattr(body, name, None) is not None for name in POOLED_FIELDS)


async def _generate(request: web.Request, job: Job) -> web.StreamResponse:
    app = request.app
    stats = request[STATS]
    stats.request_id = job.request_id
    stats.num_prompt_tokens = job.num_prompt_tokens
    await app[HEALTH_GATE].check()
    if trace.ENABLED:
        http_at = time.time() - (time.perf_counter() - stats.started_at)
        for sub_request in job.requests:
            trace.hop("gateway.http", sub_request.request_id, at=http_at)
            trace.hop("gateway.prepared", sub_request.request_id)
    choices = [ChoiceState(i) for i in range(len(job.requests))]
    stats.choices = choices
    renderer = Renderer(job, app[SERVED].name, app[TOKEN_TEXT])
    app[METRICS].in_flight.inc()
    try:
        async with FanOut(app[BACKEND], job.requests) as fanout:
            if job.stream:
                return await _stream(request, job, renderer, fanout, choices)
            return await _collect(renderer, fanout, choices)
    finally:
        app[METRICS].in_flight.dec()


async def _collect(renderer: Renderer, fanout: FanOut, choices: list[ChoiceState]) -> web.Response:
    while (item := await fanout.next()) is not None:
        index, event = item
        _raise_if_failed(fanout, event)
        choices[index].add(event)
    return _json(renderer.response(choices))


async def _stream(
    request: web.Request, job: Job, renderer: Renderer, fanout: FanOut, choices: list[ChoiceState]
) -> web.StreamResponse:
    """SSE. The 200 goes out once every choice has its first event, so a request the mesh refuses
    at once (busy, no worker, invalid) still gets its own HTTP status; it goes in one write with
    the opening chunks and those of the events read so far (the first tokens)."""
    early: list[tuple[int, TokenEvent]] = []
    waiting = set(range(len(job.requests)))
    while waiting and (item := await fanout.next()) is not None:
        _raise_if_failed(fanout, item[1])
        early.append(item)
        waiting.discard(item[0])
        choices[item[0]].note_prompt(item[1])
    sse = EventStream(job.include_usage)
    try:
        await sse.start(request)
        opening = renderer.first_chunks(choices)
        for index, event in early:
            choices[index].add(event)
            opening += renderer.chunks(choices[index], event)
        await sse.send(*opening)
        for _, event in early:
            trace.hop("gateway.sent", event.request_id, event.num_output_tokens)
        while (item := await fanout.next()) is not None:
            index, event = item
            if event.error is not None:
                fanout.cancel_reason = f"another choice failed: {event.error.message}"
                request[STATS].status = event.error.code
                await sse.fail(APIError.from_mesh(event.error))
                break
            choices[index].add(event)
            await _send_chunks(sse, renderer, choices[index], event)
            trace.hop("gateway.sent", event.request_id, event.num_output_tokens)
        else:
            if job.include_usage:
                await sse.send(renderer.usage_chunk(choices))
            await sse.done()
    except ConnectionResetError:  # the client went away; leaving the FanOut cancels the rest
        request[STATS].status = CLIENT_CLOSED
    return sse.response


async def _send_chunks(sse: EventStream, renderer: Renderer, choice: ChoiceState, event: TokenEvent) -> None:
    """The event's chunks: a text delta from its choice's template, any other built and serialized."""
    delta = renderer.delta_event(choice, event)
    if delta is not None:
        await sse.send_bytes(delta)
        return
    await sse.send(*renderer.chunks(choice, event))


def _raise_if_failed(fanout: FanOut, event: TokenEvent) -> None:
    if event.error is not None:
        fanout.cancel_reason = f"another choice failed: {event.error.message}"
        raise APIError.from_mesh(event.error)


# ---- the rest ----------------------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    return _json(ModelList(data=[_model_card(request.app[SERVED])]))


async def retrieve_model(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    check_model(request.match_info["model"], served, param=None)
    return _json(_model_card(served))


def _model_card(served: ServedModel) -> ModelCard:
    return ModelCard(
        id=served.name, created=served.created, root=served.name, max_model_len=served.max_model_len
    )


async def tokenize_endpoint(request: web.Request) -> web.Response:
    return _json(await _prepared(request, TokenizeRequest, tokenize))


async def detokenize_endpoint(request: web.Request) -> web.Response:
    return _json(await _prepared(request, DetokenizeRequest, detokenize))


async def health(request: web.Request) -> web.Response:
    ok, reason = await request.app[BACKEND].health()
    return _json(HealthStatus(status="ok" if ok else "unavailable", reason=reason), 200 if ok else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_JSON], content_type="application/json")


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=body.model_dump_json().encode(), status=status, content_type="application/json")


HANDLERS: dict[str, Handler] = {
    "createCompletion": create_completion,
    "createChatCompletion": create_chat_completion,
    "listModels": list_models,
    "retrieveModel": retrieve_model,
    "tokenize": tokenize_endpoint,
    "detokenize": detokenize_endpoint,
    "health": health,
    "metrics": metrics_endpoint,
    "openapi": openapi_endpoint,
}
"""The handler of each operation of `openapi.OPERATIONS`, by operation id."""
