"""From an OpenAI request body to what the engine runs: prompt token ids and ``SamplingParams``.

Everything a client can get wrong is caught here, before the request queues, with a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from core.errors import InvalidRequest
from server.engine import SamplingParams
from server.engine.errors import PromptTooLong
from server.engine.front import EngineFront
from server.engine.grammar import JSON_OBJECT_SCHEMA, canonical_schema
from server.engine.tenancy import Priority, Tenancy
from server.openai_schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def completion_prompt(body: CompletionRequest, front: EngineFront) -> list[int]:
    """Token ids of ``prompt``: a string, or a list of token ids (a one-element batch of either is accepted)."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty", param="prompt")
        return front.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise InvalidRequest("prompt is an empty list of token ids", param="prompt")
        vocab = front.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list):
        raise InvalidRequest(
            "prompt must be one string or one list of token ids; send batches as separate requests", param="prompt"
        )
    raise InvalidRequest("prompt is required: a string or a list of token ids", param="prompt")


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """``messages`` as ``[{"role", "content"}]`` with text content (plus an assistant's ``tool_calls``, arguments
    as objects as chat templates expect, and a tool result's ``tool_call_id``), or a 400 saying which is wrong."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"{where} must be an object with role and content", param=where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(CHAT_ROLES)}", param=f"{where}.role")
        converted: dict[str, Any] = {
            "role": role,
            "content": _text_content(message.get("content"), role, f"{where}.content"),
        }
        if role == "assistant" and message.get("tool_calls"):
            converted["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise InvalidRequest(f"{where}.tool_call_id must name the call answered", param=f"{where}.tool_call_id")
            converted["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            converted["name"] = message["name"]
        messages.append(converted)
    return messages


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise InvalidRequest(
            f"{where} must be a list of {{id, type: function, function: {{name, arguments}}}}", param=where
        )
    calls = []
    for j, call in enumerate(raw):
        here = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{here} must be {{id, type: function, function: {{name, arguments}}}}", param=here)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (json.JSONDecodeError, RecursionError):  # nesting deep enough to exhaust the parser's stack
                raise InvalidRequest(
                    f"{here}.function.arguments must be a JSON object (as text)", param=f"{here}.function.arguments"
                ) from None
        if not isinstance(arguments, dict):
            raise InvalidRequest(f"{here}.function.arguments must be a JSON object", param=f"{here}.function.arguments")
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _text_content(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequest(f"{where}: only text parts ({{type: text, text}}) are supported", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(f"{where} must be a string or a list of text parts", param=where)


def chat_prompt(
    body: ChatCompletionRequest, front: EngineFront, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of the conversation rendered with the tokenizer's chat template (``tools`` checked ones)."""
    messages = chat_messages(body.messages)
    tokenizer = front.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja raises whatever the template author chose
        raise InvalidRequest(f"the chat template rejected these messages: {exc}", param="messages") from None
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if not ids:
        raise InvalidRequest("the rendered conversation is empty", param="messages")
    return ids


def refuse_unsupported(body: GenerationRequest) -> None:
    """400 for parameters this server would otherwise silently ignore."""
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise InvalidRequest("echo is not supported by this server", param="echo")
        if body.suffix:
            raise InvalidRequest("suffix is not supported by this server", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequest("best_of is not supported; ask for n completions instead", param="best_of")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def sampling_params(
    body: GenerationRequest, prompt_len: int, max_model_len: int, max_n: int, grammar: str | None = None
) -> SamplingParams:
    """The engine's parameters, with the context limit checked against prompt length and max_tokens; ``grammar``
    (Lark) forces a tool call."""
    refuse_unsupported(body)
    if grammar is not None and body.response_format is not None and response_schema(body.response_format):
        raise InvalidRequest(
            "response_format cannot be combined with a tool_choice that forces a call", param="response_format"
        )
    if body.n > max_n:
        raise InvalidRequest(f"n is {body.n}; this server generates at most {max_n} completions", param="n")
    if prompt_len >= max_model_len:
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise PromptTooLong(
            f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} tokens", param=param
        )
    room = max_model_len - prompt_len
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        assert isinstance(body, CompletionRequest)
        max_tokens, logprobs = body.max_tokens, body.logprobs
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise PromptTooLong(
            f"max_tokens is {max_tokens} but the prompt has {prompt_len} tokens and the context is "
            f"{max_model_len}: at most {room} tokens can be generated",
            param="max_tokens",
        )
    return SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=body.skip_special_tokens,
        json_schema=response_schema(body.response_format),
        grammar=grammar,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0,
        logit_bias=token_biases(body.logit_bias),
    )


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with integer keys; ranges are checked downstream."""
    biases = {}
    for key, bias in (logit_bias or {}).items():
        if not (key.isascii() and key.strip().isdigit()):
            raise InvalidRequest(f"logit_bias keys must be token ids (got {key!r})", param="logit_bias")
        biases[int(key)] = bias
    return biases


def response_schema(response_format: Any) -> str | None:
    """The canonical JSON schema ``response_format`` asks for: None for text, any object for ``json_object``."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise InvalidRequest(
            "response_format must be {type: text}, {type: json_object} or {type: json_schema, json_schema: {...}}",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("response_format.json_schema needs a name and a schema", param="response_format")
    schema = spec.get("schema", {})  # OpenAI's default: any JSON value
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    # strict is always honoured: every completion that finishes with "stop" matches the schema.
    return canonical_schema(schema)


def tenancy(body: GenerationRequest) -> Tenancy:
    """Whose the request is (the control plane's tenant tag; none: the direct tenant) and its class."""
    priority = Priority.BATCH if body.service_tier == "flex" else Priority.INTERACTIVE
    if body.tenant is None:
        return Tenancy(priority=priority)
    return Tenancy(body.tenant.id, body.tenant.weight, priority)
