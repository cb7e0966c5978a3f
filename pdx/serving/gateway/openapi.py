"""The gateway's OpenAPI 3 document, generated from the request and response models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pdx.serving.gateway.protocol import (
    ChatCompletionBody,
    ChatCompletionResponse,
    CompletionBody,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "invalid request: the error's `param` names the field",
    "404": "unknown model (`model_not_found`)",
    "408": "the request body did not arrive in time",
    "413": "request body too large",
    "429": "no decode capacity; retry after `Retry-After` seconds",
    "500": "internal error",
    "502": "a decode instance failed before the first token",
    "503": "no decode instance is up (restarting); retry after `Retry-After` seconds",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: _json(_ref(ErrorResponse), _ERRORS[c]) for c in codes}


def _generate(body: type[BaseModel], reply: type[BaseModel], summary: str) -> dict[str, Any]:
    ok = _json(_ref(reply), "the completion (stream: false)")
    # One server-sent event (stream: true): data is a JSON chunk, or [DONE] at the end.
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    ok["content"]["text/event-stream"] = {"schema": event}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(body)}}},
            "responses": {"200": ok, **_errors(*_ERRORS)},  # every one may answer a generation
        }
    }  # fmt: skip


def _get(schema: dict[str, Any], summary: str, *, errors: tuple[str, ...] = ("500",),
         media: str = "application/json") -> dict[str, Any]:  # fmt: skip
    ok = {"description": summary, "content": {media: {"schema": schema}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def openapi_document(model_names: list[str]) -> dict[str, Any]:
    """The whole document; ``model_names`` are listed in the ``model`` fields' descriptions."""
    models: list[type[BaseModel]] = [CompletionBody, ChatCompletionBody, CompletionResponse,
                                     ChatCompletionResponse, ErrorResponse, ModelCard,
                                     ModelList]  # fmt: skip
    _, schemas = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    ready = {
        "type": "object",
        "required": ["ready", "decode_healthy"],
        "properties": {
            "ready": {"type": "boolean"},
            "decode_healthy": {"type": "array", "items": {"type": "string"}},
            "roles_down": {"type": "array", "items": {"type": "object"}},
            "children": {"type": "array", "items": {"type": "object"}},
        },
    }
    model_item = _get(_ref(ModelCard), "one served model", errors=("404", "500"))
    model_item["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    readyz = _get(ready, "at least one decode instance is healthy")
    readyz["get"]["responses"]["503"] = _json(ready, "no healthy decode instance")
    paths = {
        "/v1/completions": _generate(CompletionBody, CompletionResponse, "text completion"),
        "/v1/chat/completions": _generate(ChatCompletionBody, ChatCompletionResponse,
                                          "chat completion"),
        "/v1/models": _get(_ref(ModelList), "the served models"),
        "/v1/models/{model}": model_item,
        "/metrics": _get({"type": "string"}, "Prometheus text exposition", media="text/plain"),
        "/healthz": _get({"type": "object", "required": ["status"],
                          "properties": {"status": {"type": "string"}}}, "the gateway answers"),
        "/readyz": readyz,
        "/openapi.json": _get({"type": "object"}, "this document"),
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdx gateway (OpenAI-compatible)", "version": "1",
                 "description": f"served models: {', '.join(model_names)}"},
        "paths": paths,
        "components": {"schemas": schemas["$defs"]},
    }  # fmt: skip
