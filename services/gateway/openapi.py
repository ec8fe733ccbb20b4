"""The gateway's HTTP API as an OpenAPI 3.1 document, served at `GET /openapi.json`.

Generated, never written by hand: every `Operation` below names the pydantic models its handler
parses and builds, and `create_app` routes exactly these operations, so the document describes
every route. Bodies' JSON Schemas come from pydantic (JSON Schema 2020-12, the dialect of OpenAPI
3.1): requests in validation mode, answers in serialization mode (what the handler sends). A
streamed answer (`stream: true`) is server-sent events: the `text/event-stream` schema describes one
event, as OpenAPI 3.2's `itemSchema` does (and as schemathesis reads a 3.1 stream's `schema`), its
`data` JSON given by `contentSchema`.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from services.gateway.openai_api import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

OPENAPI_VERSION = "3.1.0"
SCHEMA_REF = "#/components/schemas/{model}"
METRICS_MEDIA_TYPE = "text/plain"
SSE_MEDIA_TYPE = "text/event-stream"
SSE_DESCRIPTION = (
    "With `stream: true`, server-sent events: one `data: <chunk>` event per chunk, then "
    "`data: [DONE]`. A request that fails after the 200 ends with an `ErrorResponse` event "
    "instead, and no `[DONE]`."
)
SSE_DONE = "[DONE]"
ERRORS: dict[int, str] = {
    400: "Invalid request: the message says what is wrong, `param` names the field.",
    401: "Missing or unknown API key.",
    404: "`model` (in the body or the path) names a model this gateway does not serve.",
    408: "The body did not arrive within the body timeout; the connection is closed.",
    413: "The body is larger than the gateway's body limit; the connection is closed.",
    429: "Too many requests in flight (this API key's, or the mesh's queue); retry after `Retry-After` s.",
    500: "The request failed in the mesh or the gateway; the message names the request for the logs.",
    503: "No worker can take the request, or the bus does not answer.",
    504: "The mesh sent nothing for the request for the gateway's request timeout.",
}
"""What each error status means; every one has an `ErrorResponse` body."""
GENERATION_ERRORS = (400, 404, 408, 413, 429, 500, 503, 504)
Refs = dict[tuple[Any, JsonSchemaMode], dict[str, Any]]
"""Each (model, mode)'s `{"$ref": ...}` into components/schemas."""
RETRY_AFTER_HEADER = {
    "description": "Seconds to wait before retrying.",
    "schema": {"type": "integer", "minimum": 0},
}


@dataclass(frozen=True)
class Answer:
    """One status's body: JSON of `model`, and with `stream_chunk` also SSE; or `text` of a media type."""

    description: str
    model: type[BaseModel] | None = None
    stream_chunk: type[BaseModel] | None = None
    text: str | None = None


@dataclass(frozen=True)
class Operation:
    """One route: its method and path, what it reads and what it answers."""

    method: Literal["GET", "POST"]
    path: str
    operation_id: str
    summary: str
    request: type[BaseModel] | None = None
    """The JSON body it parses."""
    answers: dict[int, Answer] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    """Statuses it answers with an `ErrorResponse` (401 is added where API keys are required)."""
    json_object: bool = False
    """The 200 is a free-form JSON object (this document)."""
    path_params: dict[str, str] = field(default_factory=dict)
    """Each `{name}` of the path (a string) and what it is."""

    @property
    def authenticated(self) -> bool:
        """Whether it takes the API key, when the gateway has keys."""
        return self.path.startswith("/v1/")


COMPLETIONS = Operation(
    "POST",
    "/v1/completions",
    "createCompletion",
    "Complete one or more prompts (OpenAI's legacy completions).",
    request=CompletionRequest,
    answers={200: Answer("The completion.", Completion, stream_chunk=Completion)},
    errors=GENERATION_ERRORS,
)
CHAT_COMPLETIONS = Operation(
    "POST",
    "/v1/chat/completions",
    "createChatCompletion",
    "Answer a conversation, rendered with the model's chat template.",
    request=ChatCompletionRequest,
    answers={200: Answer("The chat completion.", ChatCompletion, stream_chunk=ChatCompletionChunk)},
    errors=GENERATION_ERRORS,
)
MODELS = Operation(
    "GET",
    "/v1/models",
    "listModels",
    "The one model this gateway serves.",
    answers={200: Answer("The served model.", ModelList)},
)
MODEL = Operation(
    "GET",
    "/v1/models/{model}",
    "retrieveModel",
    "The served model, by its id (OpenAI's retrieve model).",
    answers={200: Answer("The served model.", ModelCard)},
    errors=(404,),
    path_params={"model": "The model's id: the served model's name."},
)
TOKENIZE = Operation(
    "POST",
    "/tokenize",
    "tokenize",
    "Token ids of a prompt, or of messages rendered with the chat template (vLLM's /tokenize).",
    request=TokenizeRequest,
    answers={200: Answer("The token ids.", TokenizeResponse)},
    errors=(400, 404, 408, 413),
)
DETOKENIZE = Operation(
    "POST",
    "/detokenize",
    "detokenize",
    "The text of token ids (vLLM's /detokenize).",
    request=DetokenizeRequest,
    answers={200: Answer("The text.", DetokenizeResponse)},
    errors=(400, 404, 408, 413),
)
HEALTH = Operation(
    "GET",
    "/health",
    "health",
    "Whether the bus answers and a worker is live (from a probe every second: answers at once).",
    answers={
        200: Answer("The mesh can serve.", HealthStatus),
        503: Answer("The bus does not answer, or no worker is live.", HealthStatus),
    },
)
METRICS = Operation(
    "GET",
    "/metrics",
    "metrics",
    "Prometheus metrics of this gateway process.",
    answers={200: Answer("Prometheus text exposition format.", text=METRICS_MEDIA_TYPE)},
)
OPENAPI = Operation(
    "GET",
    "/openapi.json",
    "openapi",
    "This document.",
    answers={200: Answer("The OpenAPI 3.1 description of this gateway's HTTP API.")},
    json_object=True,
)
OPERATIONS = (
    COMPLETIONS,
    CHAT_COMPLETIONS,
    MODELS,
    MODEL,
    TOKENIZE,
    DETOKENIZE,
    HEALTH,
    METRICS,
    OPENAPI,
)


def openapi_document(
    operations: tuple[Operation, ...], *, model_name: str, api_keys_required: bool
) -> dict[str, Any]:
    """The document for a gateway serving `model_name`; with `api_keys_required`, /v1/* operations
    take a bearer key. GET operations are served for HEAD too, and described for both."""
    schemas, refs = _component_schemas(operations)
    paths: dict[str, dict[str, Any]] = {}
    for operation in operations:
        described = _operation(operation, refs, api_keys_required)
        methods = paths.setdefault(operation.path, {})
        methods[operation.method.lower()] = described
        if operation.method == "GET":
            methods["head"] = _head(operation, described)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "specmesh gateway",
            "version": _version(),
            "description": f"OpenAI-compatible API of a specmesh mesh serving `{model_name}`.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _component_schemas(
    operations: tuple[Operation, ...],
) -> tuple[dict[str, Any], Refs]:
    """Every model's JSON Schema under components/schemas, and the `$ref` of each (model, mode)."""
    wanted: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {(ErrorResponse, "serialization"): None}
    for operation in operations:
        if operation.request is not None:
            wanted[(operation.request, "validation")] = None
        for answer in operation.answers.values():
            for model in (answer.model, answer.stream_chunk):
                if model is not None:
                    wanted[(model, "serialization")] = None
    refs, definitions = models_json_schema(list(wanted), ref_template=SCHEMA_REF)
    return definitions.get("$defs", {}), refs


def _operation(
    operation: Operation,
    refs: Refs,
    api_keys_required: bool,
) -> dict[str, Any]:
    described: dict[str, Any] = {"operationId": operation.operation_id, "summary": operation.summary}
    if operation.path_params:
        described["parameters"] = [
            {"name": name, "in": "path", "required": True, "description": text, "schema": {"type": "string"}}
            for name, text in operation.path_params.items()
        ]
    if operation.request is not None:
        described["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(operation.request, "validation")]}},
        }
    responses = {
        str(status): _answer(answer, refs, operation) for status, answer in operation.answers.items()
    }
    errors = set(operation.errors)
    if api_keys_required and operation.authenticated:
        described["security"] = [{"bearer": []}]
        errors.add(401)
    error_ref = refs[(ErrorResponse, "serialization")]
    for status in sorted(errors):
        response: dict[str, Any] = {
            "description": ERRORS[status],
            "content": {"application/json": {"schema": error_ref}},
        }
        if status == 429:
            response["headers"] = {"Retry-After": RETRY_AFTER_HEADER}
        responses[str(status)] = response
    described["responses"] = responses
    return described


def _answer(answer: Answer, refs: Refs, operation: Operation) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if answer.model is not None:
        content["application/json"] = {"schema": refs[(answer.model, "serialization")]}
    elif operation.json_object:
        content["application/json"] = {"schema": TypeAdapter(dict[str, Any]).json_schema()}
    if answer.stream_chunk is not None:
        chunk_or_error = [
            refs[(answer.stream_chunk, "serialization")],
            refs[(ErrorResponse, "serialization")],
        ]
        content[SSE_MEDIA_TYPE] = {"schema": _sse_event(chunk_or_error)}
    if answer.text is not None:
        content[answer.text] = {"schema": {"type": "string"}}
    description = f"{answer.description} {SSE_DESCRIPTION}" if answer.stream_chunk else answer.description
    return {"description": description, "content": content}


def _sse_event(data_schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One server-sent event: its `data` is `[DONE]` or JSON valid against one of `data_schemas`."""
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": data_schemas},
    }
    return {
        "type": "object",
        "properties": {"data": {"anyOf": [{"const": SSE_DONE}, json_data]}},
        "required": ["data"],
    }


def _head(operation: Operation, described: dict[str, Any]) -> dict[str, Any]:
    """A GET's HEAD twin: the same statuses and headers, no body."""
    responses = {
        status: {k: v for k, v in response.items() if k != "content"}
        for status, response in described["responses"].items()
    }
    return {**described, "operationId": f"{operation.operation_id}Head", "responses": responses}


def _version() -> str:
    try:
        return importlib.metadata.version("specmesh")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"
