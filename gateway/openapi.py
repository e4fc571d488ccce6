"""The OpenAPI 3.1 document the gateway publishes at GET /openapi.json.

Written by hand from ``gateway/protocol.py``'s rules and built from its constants, so a limit changes in
one place. ``tests/gateway/test_fuzz.py`` checks it stays truthful: values the schema allows are served,
values at its bounds' far side are refused with 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from gateway.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_SEQUENCES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    REPETITION_PENALTY_RANGE,
    ROLES,
    TOOL_NAME,
)
from verify.sampling import MAX_LOGPROBS

INT64 = {"minimum": -(2**63), "maximum": 2**64 - 1}  # what torch.Generator accepts as a seed


def _num(low: float | None = None, high: float | None = None, kind: str = "number", **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": [kind, "null"], **extra}
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def _common(max_model_len: int) -> dict[str, Any]:
    """Fields both generation routes share. ``null`` always means "absent"."""
    stop_string = {"type": "string", "maxLength": MAX_STOP_CHARS}
    return {
        "model": {"type": ["string", "null"], "description": "must name the served model when given"},
        "max_tokens": _num(1, max_model_len, "integer"),
        "temperature": _num(0, 2, description="below 1e-5 means greedy"),
        "top_p": _num(None, 1, exclusiveMinimum=0),
        "top_k": _num(-1, None, "integer", description="0 or -1 = off"),
        "min_p": _num(0, 1, description="drop tokens less likely than min_p times the most likely; 0 = off"),
        "seed": {"type": ["integer", "null"], **INT64},
        "presence_penalty": _num(-2, 2),
        "frequency_penalty": _num(-2, 2),
        "repetition_penalty": _num(*REPETITION_PENALTY_RANGE),
        "ignore_eos": {"type": ["boolean", "null"]},
        "min_tokens": {"type": ["integer", "null"], "minimum": 0},
        "include_stop_str_in_output": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"]},
        "allowed_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}, "minItems": 1,
                              "maxItems": MAX_ALLOWED_TOKEN_IDS},
        "truncate_prompt_tokens": {"type": ["integer", "null"], "minimum": -1, "not": {"const": 0}},
        "stop": {"oneOf": [stop_string, {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                           "maxItems": MAX_STOP_TOKEN_IDS},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {
            "include_usage": {"type": ["boolean", "null"]}, "continuous_usage_stats": {"type": ["boolean", "null"]}}},
        "n": _num(1, MAX_CHOICES, "integer", description="choices; each is a sequence of its own, seeds seed + i"),
        "best_of": {"type": ["integer", "null"], "description": "must equal n"},
        "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "token id -> bias added to its logit before penalties and temperature"},
        "speculation": {"$ref": "#/components/schemas/Speculation"},
        "response_format": {"oneOf": [
            {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": {"type": "string"}, "schema": {"type": "object"},
                    "strict": {"type": ["boolean", "null"]}}}}},
            {"type": "null"}], "description": "structured output: every token keeps the output inside the schema"},
        "structured_outputs": {"type": ["object", "null"], "minProperties": 1, "maxProperties": 1,
                               "additionalProperties": False, "properties": {
                                   "json": {"type": ["object", "string"]}, "regex": {"type": "string"},
                                   "choice": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                                   "grammar": {"type": "string", "description": "Lark or GBNF"}},
                               "description": "vLLM's structured output: exactly one of json, regex, choice, grammar"},
    }


def _speculation() -> dict[str, Any]:
    return {"type": ["object", "null"], "additionalProperties": False, "properties": {
        "enabled": {"type": ["boolean", "null"]},
        "drafter": {"type": ["string", "null"], "description": "a name from GET /v1/models"},
        "max_nodes": {"type": ["integer", "null"], "minimum": 0},
        "tree": {"oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 1}},
                           {"type": "string", "pattern": r"^\s*\d+(\s*,\s*\d+)*\s*$"}, {"type": "null"}],
                 "description": "draft tree widths per depth"}}}


def _bodies(max_model_len: int) -> dict[str, Any]:
    common = _common(max_model_len)
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}, {"type": "null"}]}}}
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1, "maxItems": max_model_len - 1}
    prompt = {"oneOf": [text, ids, {"type": "array", "items": {"oneOf": [text, ids]}, "minItems": 1,
                                    "maxItems": MAX_SEQUENCES}],
              "description": f"one prompt or a batch (each with n choices; at most {MAX_SEQUENCES} sequences); "
                             f"each prompt with its generation at most {max_model_len} tokens"}
    chat = {"type": "object", "required": ["messages"], "properties": common | {
        "messages": {"type": "array", "items": message, "minItems": 1, "maxItems": MAX_MESSAGES},
        "max_completion_tokens": common["max_tokens"],
        "logprobs": {"type": ["boolean", "null"], "description": "each output token's log-probability under the "
                     "target's raw distribution (before bias, penalties and temperature)"},
        "top_logprobs": _num(0, MAX_LOGPROBS, "integer", description="most likely alternatives per token; "
                             "needs logprobs: true"),
        "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "pattern": TOOL_NAME.pattern}, "description": {"type": "string"},
                    "parameters": {"type": "object"}}}}}},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]},
                                  {"type": "object", "required": ["type", "function"], "properties": {
                                      "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                                                  "properties": {"name": {"type": "string"}}}}},
                                  {"type": "null"}],
                        "description": "auto (the default with tools): text, or one call written "
                                       "<tool_call>{...}</tool_call>; required or a named function: one call. Calls "
                                       "are constrained to the tools' schemas"}}}
    completion = {"type": "object", "required": ["prompt"], "properties": common | {
        "prompt": prompt,
        "echo": {"type": ["boolean", "null"], "description": "the prompt's text before the output; with logprobs, "
                 "its tokens' logprobs too (the first is null)"},
        "logprobs": _num(0, MAX_LOGPROBS, "integer", description="each output token's log-probability under the "
                         "target's raw distribution, with this many most likely alternatives")}}
    return {"ChatCompletionRequest": chat, "CompletionRequest": completion}


def _post(body: str, summary: str) -> dict[str, Any]:
    errors = {str(code): {"$ref": "#/components/responses/Error"} for code in (400, 401, 404, 413, 429, 503)}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}},
        "responses": {"200": {"description": "a completion (JSON), or SSE chunks ending in [DONE] when stream",
                              "content": {"application/json": {}, "text/event-stream": {}}}} | errors}}


def _plain_post(summary: str) -> dict[str, Any]:
    """A small JSON route (vLLM's tokenizer routes)."""
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {}}},
                     "responses": {"200": {"description": "OK", "content": {"application/json": {}}},
                                   "400": {"$ref": "#/components/responses/Error"},
                                   "401": {"$ref": "#/components/responses/Error"}}}}


def _get(summary: str, media: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {media: {}}},
                                                       "401": {"$ref": "#/components/responses/Error"}}}}


def _open_get(summary: str, media: str = "application/json") -> dict[str, Any]:
    """A read-only aggregate: open even when an API key is configured (gateway/guard.py OPEN_READS)."""
    return {"get": {"summary": summary, "security": [],
                    "responses": {"200": {"description": "OK", "content": {media: {}}}}}}


def openapi_schema(model_name: str, max_model_len: int, max_body_bytes: int) -> dict[str, Any]:
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    health = {"get": {"summary": "readiness (no API key)", "security": [],
                      "responses": {"200": {"description": "ready"}, "503": {"description": "warming up or draining"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "specgate", "version": "0.1.0",
                 "description": f"OpenAI-compatible speculative decoding for {model_name}. Bodies are limited to "
                                f"{max_body_bytes} bytes (413 above)."},
        "paths": {"/v1/completions": _post("CompletionRequest", "text completion"),
                  "/v1/chat/completions": _post("ChatCompletionRequest", "chat completion"),
                  "/v1/models": _get("the served model"), "/health": health,
                  "/metrics": _get("Prometheus metrics", "text/plain"), "/openapi.json": _get("this document"),
                  "/v1/stats": _open_get("live A/B figures per arm, load and audit (no API key)"),
                  "/v1/stats/stream": _open_get("the /v1/stats snapshot as SSE, about every second (no API key)",
                                                "text/event-stream"),
                  "/v1/stats/reset": {"post": {"summary": "start a new experiment: clear the stats and audit "
                                               "counters (needs the API key when one is configured)",
                                               "responses": {"200": {"description": "reset"},
                                                             "401": {"$ref": "#/components/responses/Error"}}}},
                  "/dashboard": _open_get("the live A/B dashboard, one self-contained page (no API key)",
                                          "text/html"),
                  "/tokenize": _plain_post('{"prompt": text, "add_special_tokens": bool} or {"messages": [...], '
                                           '"add_generation_prompt": bool} -> {"count", "max_model_len", "tokens"}'),
                  "/detokenize": _plain_post('{"tokens": [ids]} -> {"prompt": text}'),
                  "/tokenizer_info": _get("eos_token, bos_token, pad_token, chat_template, model_max_length")},
        "components": {
            "schemas": _bodies(max_model_len) | {"Speculation": _speculation(), "Error": error},
            "responses": {"Error": {"description": "OpenAI error shape", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
