"""OpenAI-compatible request parsing and response shapes, as plain dicts; no HTTP framework here.

Parsing checks every field's type and range and raises ``ApiError`` naming the field, so the app can
answer in OpenAI's error shape before anything reaches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from draft.params import SpeculationParams, check_widths, parse_tree
from gateway.sequence import SpecStats
from gateway.stats import Arm
from verify.grammar import GRAMMAR_KINDS, JSON_STYLE, compile_grammar
from verify.logprobs import TokenLogprob
from verify.sampling import MAX_LOGPROBS, SamplingParams

# Limits that bound the work one request can ask for; gateway/openapi.py publishes them.
MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: each choice is a sequence of its own (its own KV), so one request can fill a batch
MAX_SEQUENCES = 128  # prompts x n of one completions request (a batch of prompts, as lm-eval sends)
MAX_PRIORITY = 1_000_000  # |priority|: far above any class a deployment uses, far below the audit's replays
MAX_STOP_CHARS = 256  # per stop string: the matcher holds back up to this much text
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_ALLOWED_TOKEN_IDS = 1 << 16  # vLLM sets no bound; this one keeps a body's list in proportion to a vocabulary
GREEDY_BELOW = 1e-5  # temperatures under this are greedy: logits / 1e-30 overflow float32 to inf, then NaN
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # outside it, dividing logits overflows or zeroes them
# A file path in an exception's text: anything ending in a file name with an extension, or under a system
# root. URL paths such as /v1/completions match neither.
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-]+)*[\\/][\w\-]+\.[A-Za-z]\w*"
                   r"|/(?:home|usr|opt|tmp|var|root|work|mnt|srv|etc|proc|private|Users)(?:/[\w.\-]+)+")
ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields we know and refuse rather than silently ignore: their absence would change what the user gets.
UNSUPPORTED = {"echo": "echo", "suffix": "suffix", "functions": "the legacy functions field (use tools)",
               "function_call": "the legacy function_call field (use tool_choice)",
               "prompt_logprobs": "prompt_logprobs",
               "use_beam_search": "beam search (vLLM's use_beam_search)"}
MAX_TOOLS = 64
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": scrub(message), "type": type, "param": param, "code": code}}


def scrub(message: str, limit: int = 500) -> str:
    """An error message fit for a client: its first line, file paths cut out (engine exceptions can quote
    source locations), bounded in length (some quote the offending value back)."""
    lines = message.strip().splitlines()
    first = _PATH.sub("<path>", lines[0] if lines else "")
    return first if len(first) <= limit else first[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    is_chat: bool
    model: str | None
    messages: list[dict[str, str]] | None  # chat
    prompts: tuple[str | list[int], ...] | None  # completions: each text or token ids (a batch of prompts)
    max_tokens: int | None  # None = what the context leaves (chat) or 16 (completions, as OpenAI)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields other than max_tokens
    speculation: SpeculationParams = SpeculationParams()
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # vLLM's include_stop_str_in_output: a matched stop string ends the text, kept
    skip_special_tokens: bool = True  # vLLM's: special tokens' text (an end-of-turn marker) left out of the output
    stream: bool = False
    n: int = 1  # choices: independent sequences of one prompt (sampled ones differ; seeds go seed, seed + 1, ...)
    include_usage: bool = False  # stream_options.include_usage: a final usage chunk
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM): usage on every chunk
    echo: bool = False  # completions: the prompt's text (and with logprobs, its tokens' logprobs) before the output
    tools: tuple[dict[str, Any], ...] = ()  # chat: the functions offered, as OpenAI's tool objects
    tool_choice: str | None = None  # chat: "auto", "required" (any one tool) or a tool's name; None: text only
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (its start, a chat template's system
    # turn included, is cut); -1 keeps as many as fit beside max_tokens. None: the prompt as given.
    truncate_prompt_tokens: int | None = None
    # vLLM's priority: the scheduler's class, lower first (0 by default); aging lifts a waiting request one
    # class per ``SchedulerConfig.aging_s``, so no class starves, and preemption takes the least urgent first.
    priority: int = 0

    @property
    def num_sequences(self) -> int:
        """Engine sequences the request takes: n per prompt."""
        return self.n * (len(self.prompts) if self.prompts else 1)

    def sampling_params(self, context_left: int, choice: int = 0) -> SamplingParams:
        """Choice ``i`` of ``n`` draws with ``seed + i``, so choices differ and each one replays alone."""
        max_tokens = self.max_tokens or (max(context_left, 1) if self.is_chat else 16)
        sampling = self.sampling
        if choice and sampling.get("seed") is not None:
            sampling = sampling | {"seed": sampling["seed"] + choice}
        try:
            return SamplingParams(max_tokens=max_tokens, **sampling)
        except ValueError as exc:  # SamplingParams messages start with the field's name
            raise ApiError(400, str(exc), param=str(exc).split()[0]) from None


def parse_request(raw: bytes, is_chat: bool, spec_header: str | None = None) -> GenerateRequest:
    body = _object(raw)
    _refuse_unsupported(body, is_chat)
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    max_tokens = _get(body, "max_completion_tokens", int, None) if is_chat else None
    max_tokens = _get(body, "max_tokens", int, max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    echo = not is_chat and _get(body, "echo", bool, False)
    sampling = _sampling(body, is_chat)
    if echo and sampling["logprobs"] is not None:  # the echoed prompt's tokens get logprobs too
        sampling["prompt_logprobs"] = sampling["logprobs"]
    prompts = None if is_chat else _prompts(body)
    tools, tool_choice = _tools(body) if is_chat else ((), None)
    if sampling["grammar"] is not None and body.get("tool_choice") is None:
        tool_choice = None  # a response format and tools with no choice given: the format wins, no call
    if tool_choice is not None:
        if sampling["grammar"] is not None:
            raise ApiError(400, "a tool call's arguments follow the tool's schema: give tool_choice or "
                                "response_format / structured_outputs, not both", param="tool_choice")
        sampling["grammar"] = tool_grammar(tools, tool_choice)
    n = _choices(body)
    if prompts is not None and len(prompts) * n > MAX_SEQUENCES:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} is {len(prompts) * n} sequences; at most "
                            f"{MAX_SEQUENCES} per request", param="prompt")
    return GenerateRequest(
        is_chat=is_chat, model=_get(body, "model", str, None),
        messages=_messages(body) if is_chat else None, prompts=prompts,
        max_tokens=max_tokens, sampling=sampling, speculation=_speculation(body, spec_header),
        stop=_stop(body), include_stop=_get(body, "include_stop_str_in_output", bool, False),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True), stream=stream, n=n, echo=echo,
        tools=tools, tool_choice=tool_choice, truncate_prompt_tokens=_truncation(body), priority=_priority(body),
        include_usage=stream and _get(options, "include_usage", bool, False, "stream_options.include_usage"),
        continuous_usage=stream and _get(options, "continuous_usage_stats", bool, False,
                                         "stream_options.continuous_usage_stats"))


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def _get(body: dict, name: str, kind: type, default: Any, param: str | None = None) -> Any:
    """``body[name]`` checked against ``kind`` (JSON null = absent); bools are not numbers here."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ApiError(400, f"{param or name} must be {_TYPE_NAMES[kind]}, got {orjson.dumps(value).decode()}",
                       param=param or name)
    return value


def _truncation(body: dict) -> int | None:
    k = _get(body, "truncate_prompt_tokens", int, None)
    if k is not None and k < 1 and k != -1:
        raise ApiError(400, f"truncate_prompt_tokens must be >= 1 (the prompt tokens kept, from its end) or -1 "
                            f"(as many as fit beside max_tokens), got {k}", param="truncate_prompt_tokens")
    return k


def _priority(body: dict) -> int:
    """``priority`` (vLLM's): the request's scheduling class, lower runs first; bounded so that no request
    can rank below the server's own idle-time audit replays."""
    p = _get(body, "priority", int, 0)
    if not -MAX_PRIORITY <= p <= MAX_PRIORITY:
        raise ApiError(400, f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY} (lower runs first), "
                            f"got {p}", param="priority")
    return p


def _choices(body: dict) -> int:
    """``n``: independent completions of one prompt, each its own sequence in the engine."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be between 1 and {MAX_CHOICES}, got {n}", param="n")
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise ApiError(400, f"best_of must equal n ({n}): this server returns every choice it generates, "
                            f"got {best_of}", param="best_of")
    return n


def _refuse_unsupported(body: dict, is_chat: bool) -> None:
    for name, what in UNSUPPORTED.items():
        if name == "echo" and not is_chat:  # completions echo the prompt; chat has no such field
            continue
        if body.get(name) not in (None, False, "", [], {}):
            raise ApiError(400, f"{what} is not supported by this server", param=name)


def _sampling(body: dict, is_chat: bool) -> dict[str, Any]:
    top_k = _get(body, "top_k", int, 0)
    out = {
        "temperature": _get(body, "temperature", float, 1.0),
        "top_p": _get(body, "top_p", float, 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        "min_p": _get(body, "min_p", float, 0.0),
        "seed": _get(body, "seed", int, None),
        "presence_penalty": _get(body, "presence_penalty", float, 0.0),
        "frequency_penalty": _get(body, "frequency_penalty", float, 0.0),
        "repetition_penalty": _get(body, "repetition_penalty", float, 1.0),
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "min_tokens": _get(body, "min_tokens", int, 0),
    }
    if out["seed"] is not None and not -(2**63) <= out["seed"] < 2**64:  # what torch.Generator accepts
        raise ApiError(400, f"seed must fit in 64 bits, got {out['seed']}", param="seed")
    if out["temperature"] > 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {out['temperature']}", param="temperature")
    if 0 <= out["temperature"] < GREEDY_BELOW:
        out["temperature"] = 0.0
    low, high = REPETITION_PENALTY_RANGE
    if not low <= out["repetition_penalty"] <= high:
        raise ApiError(400, f"repetition_penalty must be in [{low}, {high}], got {out['repetition_penalty']}",
                       param="repetition_penalty")
    ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "stop_token_ids must be an array of integers", param="stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                       param="stop_token_ids")
    out["stop_token_ids"] = tuple(ids)
    out["logit_bias"] = _logit_bias(body)
    allowed = _get(body, "allowed_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in allowed):
        raise ApiError(400, "allowed_token_ids must be an array of token ids (integers >= 0)",
                       param="allowed_token_ids")
    if "allowed_token_ids" in body and body["allowed_token_ids"] is not None and not allowed:
        raise ApiError(400, "allowed_token_ids is empty: no token could be emitted (leave it out to allow all)",
                       param="allowed_token_ids")
    if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
        raise ApiError(400, f"allowed_token_ids holds at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(allowed)}",
                       param="allowed_token_ids")
    out["allowed_token_ids"] = tuple(allowed)
    out["logprobs"] = _logprobs(body, is_chat)
    out["grammar"] = _grammar(body)
    return out


def _grammar(body: dict) -> str | None:
    """Structured output, from OpenAI's ``response_format`` (``json_object``, ``json_schema``) or vLLM's
    ``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``, ``grammar``), compiled and checked."""
    specs: list[tuple[str, Any, str]] = []  # (kind, spec, the field to name in an error)
    fmt = _get(body, "response_format", dict, None)
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            specs.append(("json", {"type": "object"}, "response_format"))
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise ApiError(400, "response_format.json_schema must be an object holding a schema object",
                               param="response_format.json_schema")
            specs.append(("json", inner["schema"], "response_format.json_schema"))
        elif kind != "text":
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got "
                                f"{orjson.dumps(kind).decode()}", param="response_format")
    structured = _get(body, "structured_outputs", dict, None)
    if structured is not None:
        unknown = sorted(set(structured) - set(GRAMMAR_KINDS))
        given = [k for k in GRAMMAR_KINDS if structured.get(k) is not None]
        if unknown or len(given) != 1:
            raise ApiError(400, f"structured_outputs takes exactly one of {', '.join(GRAMMAR_KINDS)}"
                                + (f"; unknown: {', '.join(unknown)}" if unknown else ""), param="structured_outputs")
        specs.append((given[0], structured[given[0]], f"structured_outputs.{given[0]}"))
    if len(specs) > 1:
        raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    if not specs:
        return None
    kind, spec, param = specs[0]
    try:
        return compile_grammar(kind, spec)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``, biases in [-100, 100]; ids are checked against the vocabulary later."""
    bias = _get(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100
        if not ok:
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], got "
                                f"{orjson.dumps(value).decode()}", param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _logprobs(body: dict, is_chat: bool) -> int | None:
    """Alternatives per token to report, or None for no logprobs. Chat: ``logprobs: true`` with
    ``top_logprobs: K``; completions: ``logprobs: K``."""
    if not is_chat:
        if body.get("top_logprobs") is not None:
            raise ApiError(400, "top_logprobs is a chat completions field; completions take logprobs: K",
                           param="top_logprobs")
        top = _get(body, "logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="logprobs")
        return top
    wanted = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top is not None and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"each stop string holds at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(s for s in stops if s)


def _tools(body: dict) -> tuple[tuple[dict[str, Any], ...], str | None]:
    """OpenAI's ``tools`` and ``tool_choice`` (default "auto" when tools are given). "required" or a tool's
    name: the output is one call, ``{"name": ..., "arguments": {...}}`` under the tools' schemas. "auto": the
    model answers in text or makes one call written ``<tool_call>{...}</tool_call>`` (the Hermes form many
    chat models are trained on), the call again under the schemas (``AUTO_CALL``). "none": text only.
    Any model, no per-model parser: the grammar guarantees the call's shape."""
    raw = _get(body, "tools", list, [])
    if len(raw) > MAX_TOOLS:
        raise ApiError(400, f"tools holds at most {MAX_TOOLS} functions, got {len(raw)}", param="tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                "with a name of 1-64 letters, digits, _ or -", param=f"tools[{i}]")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        tools.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                       "parameters": params}})
    choice = body.get("tool_choice", "auto" if tools else None)
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice == "none":
        return tuple(tools), None
    if not tools:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice in ("auto", "required"):
        return tuple(tools), choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if name not in names:
        raise ApiError(400, f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": one of {names}}}}}", param="tool_choice")
    return tuple(tools), name


AUTO_CALL = ("<tool_call>", "</tool_call>")  # how a call is written when the model chooses to make one


def tool_call_schema(tools: tuple[dict[str, Any], ...], choice: str) -> dict[str, Any]:
    """The JSON schema a call follows: one named tool, or any of them ("required", "auto")."""
    def call(fn: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]}}

    fns = [t["function"] for t in tools if choice in ("required", "auto") or t["function"]["name"] == choice]
    return call(fns[0]) if len(fns) == 1 else {"anyOf": [call(fn) for fn in fns]}


def tool_grammar(tools: tuple[dict[str, Any], ...], choice: str) -> str:
    """The request's grammar for ``tool_choice``: the call's schema alone, or for "auto" (Lark) either a tagged
    call or text that does not start with "<" (the one character a reply gives up to keep the two apart)."""
    schema = tool_call_schema(tools, choice)
    if choice != "auto":
        return compile_grammar("json", schema)
    schema = schema | {"x-guidance": JSON_STYLE}
    open_tag, close_tag = AUTO_CALL
    lark = (f"start: call | text\ncall: {orjson.dumps(open_tag).decode()} %json {orjson.dumps(schema).decode()} "
            f"{orjson.dumps(close_tag).decode()}\ntext: /[^<][^\\x00]*/\n")
    return compile_grammar("grammar", lark)


def tool_calls(text: str, call_id: str, tagged: bool = False) -> list[dict[str, Any]] | None:
    """A finished output as OpenAI's ``tool_calls`` (arguments as a JSON string); None when it is not a call
    (text, for "auto"; or cut short by max_tokens). ``tagged``: the call is inside ``AUTO_CALL``'s tags."""
    if tagged:
        open_tag, close_tag = AUTO_CALL
        if not (text.startswith(open_tag) and text.endswith(close_tag)):
            return None
        text = text[len(open_tag) : -len(close_tag)]
    try:
        call = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return [{"id": call_id, "type": "function",
             "function": {"name": call["name"], "arguments": orjson.dumps(call["arguments"]).decode()}}]


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array of {role, content} objects", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages holds at most {MAX_MESSAGES} turns, got {len(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        content = _content(m.get("content"), where)
        if role == "assistant" and not content and m.get("tool_calls"):  # a call made earlier, as its text
            content = _calls_text(m["tool_calls"], where)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _calls_text(calls: Any, where: str) -> str:
    """An assistant turn's earlier tool calls as the JSON the model wrote them in."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
    lines = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls entries need function.name", param=f"{where}.tool_calls")
        args = fn.get("arguments", "{}")
        try:
            args = orjson.loads(args) if isinstance(args, str) else args
        except orjson.JSONDecodeError:
            raise ApiError(400, f"{where}.tool_calls arguments must be JSON", param=f"{where}.tool_calls") from None
        lines.append(orjson.dumps({"name": fn["name"], "arguments": args}).decode())
    return "\n".join(lines)


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (images and audio are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or an array of text parts", param=f"{where}.content")


def _prompts(body: dict) -> tuple[str | list[int], ...]:
    """One prompt (text or token ids) or a batch of them (an array of texts or of token-id arrays)."""
    prompt = body.get("prompt")
    if _one_prompt(prompt):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        for i, p in enumerate(prompt):
            if not _one_prompt(p):
                raise ApiError(400, f"prompt[{i}] must be a non-empty string or array of token ids", param="prompt")
        return tuple(prompt)
    raise ApiError(400, "prompt must be a non-empty string or array of token ids, or an array of those",
                   param="prompt")


def _one_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return bool(prompt)
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def _speculation(body: dict, header: str | None) -> SpeculationParams:
    enabled = True
    if header is not None:
        if header.strip().lower() not in ("on", "off"):
            raise ApiError(400, f"X-Speculation must be on or off, got {header!r}", param="X-Speculation")
        enabled = header.strip().lower() == "on"
    spec = _get(body, "speculation", dict, {})
    unknown = sorted(set(spec) - {"enabled", "max_nodes", "drafter", "tree"})
    if unknown:
        raise ApiError(400, f"speculation has unknown fields {unknown}: use enabled, max_nodes, drafter, tree",
                       param=f"speculation.{unknown[0]}")
    try:
        return SpeculationParams(
            enabled=_get(spec, "enabled", bool, enabled, "speculation.enabled"),
            drafter=_get(spec, "drafter", str, None, "speculation.drafter"), tree=_tree(spec.get("tree")),
            max_nodes=_get(spec, "max_nodes", int, None, "speculation.max_nodes"))
    except ValueError as exc:
        param = "speculation.max_nodes" if "max_nodes" in str(exc) else "speculation.tree"
        raise ApiError(400, str(exc), param=param) from None


def _tree(value: Any) -> tuple[int, ...] | None:
    """Widths per depth, as ``[2, 2, 1]`` or ``"2,2,1"``; ValueError names what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_tree(value)
    if isinstance(value, list) and all(type(w) is int for w in value):
        check_widths(tuple(value))
        return tuple(value)
    raise ApiError(400, "speculation.tree must be widths per depth, like [2, 2, 1]", param="speculation.tree")


def parse_tokenize(raw: bytes) -> tuple[str | None, list[dict[str, str]] | None, bool]:
    """POST /tokenize (vLLM's): ``{"prompt": text, "add_special_tokens": bool}`` or ``{"messages": [...],
    "add_generation_prompt": bool}``. Returns (text, messages, flag): one of text and messages is None; the flag
    is add_special_tokens for text, add_generation_prompt for messages."""
    body = _object(raw)
    if "messages" in body:
        return None, _messages(body), _get(body, "add_generation_prompt", bool, True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
    return prompt, None, _get(body, "add_special_tokens", bool, True)


def parse_detokenize(raw: bytes, vocab_size: int) -> list[int]:
    """POST /detokenize: ``{"tokens": [ids]}``, each id in the vocabulary."""
    tokens = _object(raw).get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"tokens must be an array of token ids in [0, {vocab_size})", param="tokens")
    return tokens


def _object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


# --- responses ------------------------------------------------------------------------------------


def speculation_report(is_speculative: bool, stats: SpecStats, ttft_s: float | None,
                       decode_tokens_per_s: float | None, arm: Arm | None = None) -> dict[str, Any]:
    """The request's speculation figures. Tree-aware: ``accepted_by_rank[r]`` counts accepted drafts that were
    their parent's r-th child (0 = the drafter's first choice); ``steps_by_accepted_depth[d]`` counts steps
    that accepted exactly d drafts; utilisation = kept (roots + accepted drafts) / verified nodes."""
    return {"enabled": is_speculative, "drafted_tokens": stats.drafted_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "mean_accepted_length": round(stats.mean_accepted_length, 4), "steps": stats.steps,
            "accepted_by_depth": list(stats.accepted_by_depth),
            "accepted_by_rank": list(stats.accepted_by_rank),
            "steps_by_accepted_depth": stats.steps_by_accepted_depth,
            "verified_nodes": stats.verified_nodes, "wasted_verify_tokens": stats.wasted_nodes,
            "verify_utilisation": round(stats.utilisation, 4),
            "drafter": None if arm is None else arm.drafter, "tree": None if arm is None else arm.tree,
            "ttft_s": None if ttft_s is None else round(ttft_s, 6),
            "decode_tokens_per_s": None if decode_tokens_per_s is None else round(decode_tokens_per_s, 3)}


def usage(prompt_tokens: int, completion_tokens: int,
          speculation: dict[str, Any] | list[dict[str, Any]] | None = None, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with ``prompt_tokens_details.cached_tokens`` (prompt tokens the prefix cache held) and
    ``speculation``: the request's report, or one per choice when n > 1."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if speculation is not None:
        out["speculation"] = speculation
    return out


@dataclass(frozen=True, slots=True)
class Shape:
    """What every response of one request shares."""

    is_chat: bool
    id: str
    created: int
    model: str

    def _head(self, suffix: str) -> dict[str, Any]:
        kind = "chat.completion" if self.is_chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created, "model": self.model}

    def response(self, choices: list[tuple[str, str, dict[str, Any] | None, list[dict[str, Any]] | None]],
                 usage: dict[str, Any]) -> dict[str, Any]:
        """The non-stream body: ``choices`` is (text, finish_reason, logprobs, tool_calls) per choice, in index
        order; with tool calls the message carries them and no content."""
        out = []
        for index, (text, finish_reason, logprobs, calls) in enumerate(choices):
            choice: dict[str, Any] = {"index": index}
            if calls:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            elif self.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            out.append(choice | {"logprobs": logprobs, "finish_reason": finish_reason})
        return self._head("") | {"choices": out, "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              usage: dict[str, Any] | None | bool = False, index: int = 0,
              logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One stream chunk; ``usage=False`` leaves the field out, ``None`` writes null (include_usage)."""
        choice: dict[str, Any] = {"index": index}
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:  # whole calls in one delta (each with its index, as the stream form asks)
                delta["tool_calls"] = [{"index": i} | c for i, c in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        out = self._head(".chunk" if self.is_chat else "") | {"choices": [choice]}
        if usage is not False:
            out["usage"] = usage
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._head(".chunk" if self.is_chat else "") | {"choices": [], "usage": usage}


def logprobs_body(is_chat: bool, entries: list[tuple[int, TokenLogprob | None, int]],
                  token_text: Callable[[int], tuple[str, list[int]]]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of one choice (or of one chunk's tokens). ``entries``: each token, its figures
    (None for an echoed prompt's first token, which nothing predicts) and the offset of its text in the
    choice's text; ``token_text(id)`` gives a token's (text, bytes).

    Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``. Completions
    (the legacy shape): ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``, where a
    position's map also holds the emitted token, as OpenAI's and vLLM's do. The map is keyed by text, so two
    tokens that decode alike (two halves of different characters) share a key; the emitted token's own
    figure wins it."""
    if is_chat:
        content = []
        for token, e, _ in entries:
            text, raw = token_text(token)
            top = [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in
                   ((*token_text(i), lp) for i, lp in e.top)]
            content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}
    tops: list[dict[str, float] | None] = []
    for token, e, _ in entries:
        if e is None:
            tops.append(None)
            continue
        top = {token_text(i)[0]: lp for i, lp in reversed(e.top)}  # the likelier of two alike wins
        top[token_text(token)[0]] = e.logprob
        tops.append(top)
    return {"tokens": [token_text(token)[0] for token, _, _ in entries],
            "token_logprobs": [None if e is None else e.logprob for _, e, _ in entries], "top_logprobs": tops,
            "text_offset": [offset for _, _, offset in entries]}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
