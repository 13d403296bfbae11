"""OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment).

Parses the request (pydantic), applies the chat template, tokenizes, asks the
in-process :class:`~deployments.router.Router` for a lane and streams the
result as JSON or SSE (one engine request per HTTP request, all ``n`` choices
on one stream; a completions request with several prompts is one engine request per prompt, run at
once and merged). Also serves ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``. Every response
carries ``x-lane``. Errors come back in OpenAI's format:
``{"error": {"message", "type", "param", "code"}}``.

Tracing: each completion request gets a SERVER span ``POST <path>`` that
continues the client's W3C ``traceparent`` header (or starts a trace) and ends
when the last byte is streamed; the router's ``route`` span is its child.

The handlers are methods of :class:`OpenAIFrontend`, registered on a fresh FastAPI app by :func:`openai_api`
for each deployment that serves them: :class:`OpenAIIngress` (in front of the replica deployments) and
:class:`~deployments.direct.DirectReplica` (``topology=direct``: the replica is its own ingress).

A client can force the lane with the request header ``x-lane: standard`` (skip
the persistent lane; not a fallback) or ``x-lane: persistent`` (the default
choice for eligible requests; the response's ``x-lane`` says where it ran).
"""


import asyncio
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.chat_plan import ChatPlanner
from deployments.client_text import ClientTextEncoder
from deployments.config import AppConfig
from deployments.harmony.render import without_generation_prompt
from deployments.openai_format import (
    ChatFormat,
    CompletionFormat,
    TokenText,
    merge_prompt_streams,
    to_http,
)
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    new_id,
    now,
    validation_error,
)
from deployments.replicas import engine_actor_stats
from deployments.responses_api import ResponsesRequest, serve_responses
from deployments.router import Router
from deployments.security import RequestGuard, RequestGuardMiddleware
from deployments.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    check_shape,
    check_token_ids,
    detokenize,
    encode_prompt,
    tokenize,
    tokenize_result,
    tokenizer_info,
)
from ops.telemetry.tracing import (
    ATTR_GEN_AI_INPUT_TOKENS,
    ATTR_GEN_AI_MAX_TOKENS,
    ATTR_GEN_AI_MODEL,
    ATTR_GEN_AI_OPERATION,
    ATTR_GEN_AI_OUTPUT_TOKENS,
    ATTR_GEN_AI_TEMPERATURE,
    ATTR_INGRESS_HANDLER_NS,
    ATTR_INGRESS_PLANNED_NS,
    ATTR_LANE,
    ATTR_REQUEST_ID,
    extract_context,
    get_tracer,
    setup_tracing,
)
from replicas.messages import GenerateRequest, GenerationError
from replicas.output_processor import with_text

logger = logging.getLogger(__name__)
LANE_HEADER = "x-lane"
"""Response header naming the lane that served; as a request header, forces a lane."""
FORCEABLE_LANES = ("standard", "persistent")


def _replica_guard() -> RequestGuard:
    """The running replica's keys and limits (``deployments/security.py``)."""
    return serve.get_replica_context().servable_object.guard


def _error_response(exc: OpenAIError) -> Response:
    # json.dumps escapes non-ASCII (and lone surrogates a client may send), so any echo is safe
    return Response(json.dumps(exc.body()), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


async def _openai_error(_: Request, exc: OpenAIError):
    return _error_response(exc)


async def _validation_error(_: Request, exc: RequestValidationError):
    return _error_response(validation_error(exc.errors()))


async def _http_error(_: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error_response(OpenAIError(str(exc.detail), status=exc.status_code, type_=kind))


def _route(method: str, path: str):
    """Mark an :class:`OpenAIFrontend` method as the handler of ``method path`` (:func:`openai_api` registers it)."""
    def mark(fn):
        fn._openai_route = (method, path)
        return fn
    return mark


def openai_api() -> FastAPI:
    """A fresh FastAPI app with the OpenAI routes of :class:`OpenAIFrontend`, the request guard (API keys, body size
    and timeouts, HTTP/1.0 framing, before FastAPI reads the body) and the OpenAI-style error handlers.

    One app per Serve deployment class: ``serve.ingress`` rewrites the routes of the app it is given (its methods
    get ``self`` injected as the running replica's object), so two deployments must not share one.
    """
    app = FastAPI(title="persistent-serve", version="0.1.0")
    app.add_middleware(RequestGuardMiddleware, guard=_replica_guard)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for fn in vars(OpenAIFrontend).values():
        route = getattr(fn, "_openai_route", None)
        if route is not None:
            app.add_api_route(route[1], fn, methods=[route[0]])
    return app


_SUMMED = ("kv_pages_total", "kv_pages_free", "running", "waiting", "tokens_generated")


def _pool_totals(engines: list[dict]) -> dict:
    """One lane's view for ``/debug/stats``: the engines' page/queue counts summed, and each engine."""
    totals = {key: sum(int(e.get(key, 0)) for e in engines) for key in _SUMMED}
    return {**totals, "replicas": len(engines), "engines": engines}


def _colocated_totals(engines: list[dict]) -> dict:
    """The co-located pool for ``/debug/stats``: the shared page pools summed, and per lane its pages in
    use and requests summed over the engines (``lanes``)."""
    out = _pool_totals(engines)
    out["lanes"] = {lane: {key: sum(int(e["lanes"][lane].get(key, 0)) for e in engines)
                           for key in ("kv_pages_in_use", "running", "waiting")}
                    for lane in ("standard", "persistent")}
    return out


async def _traced(stream, span, owned: bool = True):
    """Pass ``stream`` through; end the HTTP ``span`` (with lane and usage) when it ends or is closed.

    Defined above the deployment class: ``serve.ingress`` pickles the FastAPI app when the class is
    decorated, so the endpoints only see module names that exist by then.
    """
    output_tokens, lane = 0, None
    try:
        async for item in stream:
            if isinstance(item, GenerationError):
                span.set_attribute("error.type", item.reason)
            else:
                output_tokens += len(item.token_ids)
                lane = item.lane
            yield item
    finally:
        await stream.aclose()
        if lane:
            span.set_attribute(ATTR_LANE, lane)
        span.set_attribute(ATTR_GEN_AI_OUTPUT_TOKENS, output_tokens)
        if owned:
            span.end()


async def _prepend(items: list, stream):
    """``items``, then the rest of ``stream``; closing it closes ``stream``."""
    try:
        for item in items:
            yield item
        async for item in stream:
            yield item
    finally:
        await stream.aclose()


class OpenAIFrontend:
    """The OpenAI HTTP routes and everything they need: tokenizer, chat templates, request guard, router.

    Not a deployment: :class:`OpenAIIngress` (the two-deployment topology) and
    :class:`~deployments.direct.DirectReplica` (``topology=direct``) are both one, with the app of
    :func:`openai_api`. A subclass calls :meth:`_start_frontend` from its constructor.
    """

    def _start_frontend(self, config: AppConfig, persistent, standard, pool_view: bool = True) -> None:
        """Load the tokenizer and templates and make the router over ``persistent`` and ``standard`` (Serve
        handles, or anything that answers like one: :class:`~deployments.direct.LocalHandle`).

        Args:
            pool_view: the router watches the app's pool board (False: it knows only its own requests).

        Raises:
            OSError: the model's tokenizer files cannot be read.
        """
        from transformers import AutoTokenizer

        from replicas.models.loader import resolve_model

        setup_tracing(config.tracing)
        self.config = config
        self.model_name = config.engine.name
        self.max_model_len = config.engine.max_model_len
        model_dir = resolve_model(config.engine.model, progress=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.token_text = TokenText(self.tokenizer)
        self.app_name = serve.get_replica_context().app_name
        self.encoder = ClientTextEncoder(self.tokenizer, config.security.allow_special_tokens)
        self.guard = RequestGuard(config.security, config.limits, self.max_model_len)
        self.chat_planner = ChatPlanner(self.tokenizer, model_dir, config.harmony_start_date, encoder=self.encoder)
        self.router = Router(
            config.persistent_decoder, persistent if config.persistent_enabled else None, standard,
            self.max_model_len, config.spillover_wait_s, app_name=self.app_name if pool_view else None,
            colocated=config.colocated_enabled or config.direct,
            wait_for_persistent=(config.colocated_enabled or config.direct
                                 or config.persistent_pool.min_replicas > 0),
            direct_stream=config.direct_stream,
        )
        self.persistent, self.standard = persistent, standard

    # ---- endpoints -------------------------------------------------------------------------
    @_route("GET", "/health")
    async def health(self):
        """200 once the router has reached every pool it routes to; until then 503 naming the missing ones.
        Answers within about 20 ms plus the proxy hop (``Router.readiness``: the pools are probed in the background)."""
        missing = await self.router.readiness()
        if missing:
            return JSONResponse({"status": "starting", "missing": missing,
                                 "message": f"waiting for the {' and '.join(missing)} pool to answer"},
                                status_code=503, headers={"retry-after": "1"})
        return {"status": "ok"}

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": now(), "owned_by": "persistent-serve",
                "max_model_len": self.max_model_len}

    @_route("GET", "/v1/models")
    async def models(self):
        """OpenAI's model list: the one served model."""
        return {"object": "list", "data": [self._model_card()]}

    @_route("GET", "/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        """OpenAI's ``GET /v1/models/{id}`` (``client.models.retrieve``): the served model's card, else a 404
        ``model_not_found``."""
        self._check_model(model_id)
        return self._model_card()

    @_route("GET", "/debug/stats")
    async def stats(self):
        """KV page accounting per lane, summed over every live engine of this app, plus router counters.

        ``kv_pages_free == kv_pages_total`` for each lane when no request is in flight; anything
        else once traffic has stopped is a leak (the reliability tests read exactly this).
        """
        if self.router.colocated:
            out = {"colocated": _colocated_totals(await engine_actor_stats("colocated", self.app_name))}
        else:
            out = {"standard": _pool_totals(await engine_actor_stats("standard", self.app_name))}
        if self.router.persistent is not None and not self.router.colocated:
            out["persistent"] = _pool_totals(await engine_actor_stats("persistent", self.app_name))
        out["router"] = self.router.stats()
        out["ingress"] = self.chat_planner.describe()
        out["security"] = self.guard.stats()
        return out

    @_route("POST", "/v1/chat/completions")
    async def chat(self, body: ChatCompletionRequest, request: Request):
        entered = time.time_ns()
        self._check_common(body)
        plan = await asyncio.to_thread(self.chat_planner.plan, body)  # templating + tokenizing off the event loop
        return await self._serve(body, plan.token_ids, chat=True, http=request, plan=plan, entered_ns=entered)

    @_route("POST", "/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        return await serve_responses(self, body, request)

    @_route("POST", "/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        entered = time.time_ns()
        self._check_common(body)
        prompts = []
        for prompt in body.prompt:  # one or more (OpenAI's batched prompts)
            if isinstance(prompt, str):
                ids, echo = await asyncio.to_thread(encode_prompt, self.encoder, prompt), prompt
            else:
                ids = list(prompt)
                check_token_ids(self.tokenizer, ids, "prompt")
                echo = self.tokenizer.decode(ids) if body.echo else ""
            prompts.append((ids, echo if body.echo else ""))
        return await self._serve(body, prompts[0][0], chat=False, echo=prompts[0][1], http=request,
                                 prompts=prompts if len(prompts) > 1 else None, entered_ns=entered)

    @_route("GET", "/tokenizer_info")
    async def tokenizer_info(self):
        """vLLM's ``GET /tokenizer_info`` (lm-eval's remote tokenizer reads it): see ``tokenize_api``."""
        return tokenizer_info(self.tokenizer, self.max_model_len)

    @_route("POST", "/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """vLLM's ``POST /tokenize``: a prompt's ids, or the ids the chat endpoint counts as ``prompt_tokens`` for
        ``messages`` (with ``tools``, ``tool_choice``, ``reasoning_effort``, ``response_format``: for a harmony
        model the same plan as the chat request's; ``add_generation_prompt: false`` leaves out the final
        ``<|start|>assistant``). 400 for unknown fields or chat fields with a prompt."""
        self._check_model(body.model)
        self.guard.check_request(body)
        check_shape(body)
        if body.messages is not None and (self.chat_planner.harmony or body.tools):
            plan = await asyncio.to_thread(self.chat_planner.plan, body.chat_request())  # the chat endpoint's plan
            ids = plan.token_ids
            if not body.add_generation_prompt and self.chat_planner.harmony:
                ids = without_generation_prompt(ids)
            return tokenize_result(self.tokenizer, ids, self.max_model_len, body.return_token_strs)
        return await asyncio.to_thread(tokenize, self.encoder, body, self.max_model_len)

    @_route("POST", "/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        return await asyncio.to_thread(detokenize, self.tokenizer, body)

    # ---- helpers ---------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", status=404,
                              param="model", code="model_not_found")

    def _check_common(self, body) -> None:
        self._check_model(body.model)
        body.check()
        self.guard.check_request(body)

    def _request(self, body, ids: list[int], plan=None) -> GenerateRequest:
        """One engine request for all ``n`` choices (the engine derives per-choice seeds)."""
        if not ids:
            raise OpenAIError("the prompt is empty", param="prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"has {len(ids)} tokens (prompt + at least 1 output token must fit).",
                param="messages" if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
        limit = body.output_limit()  # None: the endpoint's default (rest of the context; 16 for completions)
        if limit is not None and limit > room:  # as OpenAI and vLLM: refuse, do not silently truncate
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + limit} tokens ({len(ids)} in the prompt, {limit} for the completion). Please reduce "
                "the prompt or the completion length.",
                param="max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens",
                code="context_length_exceeded")
        params = body.sampling_params(limit or body.default_output_limit(room))
        return GenerateRequest(new_id("req"), ids, plan.apply(params) if plan is not None else params)

    @staticmethod
    def _lane_override(http: Request | None) -> str | None:
        value = http.headers.get(LANE_HEADER) if http is not None else None
        if value is None or value.strip().lower() in ("", "auto"):
            return None
        value = value.strip().lower()
        if value not in FORCEABLE_LANES:
            raise OpenAIError(f"header {LANE_HEADER} must be one of auto, {', '.join(FORCEABLE_LANES)}; "
                              f"got {value!r}", param=LANE_HEADER)
        return value

    def _http_span(self, http: Request | None, body, chat: bool):
        """The SERVER span of one completion request, continuing the client's ``traceparent``.

        FastAPI >= 0.16x opens that span itself when a tracer provider is installed (its native
        telemetry, ``scope["fastapi.telemetry"]``); then it is reused and FastAPI ends it. Otherwise
        one is opened here. Returns ``(span, owned)``: ``owned`` spans are ended by this module.
        """
        from opentelemetry.trace import SpanKind

        attributes = {ATTR_GEN_AI_OPERATION: "chat" if chat else "text_completion",
                      ATTR_GEN_AI_MODEL: self.model_name,
                      ATTR_GEN_AI_TEMPERATURE: float(body.temperature if body.temperature is not None else 1.0)}
        native = getattr(http.scope.get("fastapi.telemetry"), "span", None) if http is not None else None
        if native is not None and native.is_recording():
            native.set_attributes(attributes)
            return native, False
        path = http.url.path if http is not None else ("/v1/chat/completions" if chat else "/v1/completions")
        return get_tracer().start_span(
            f"POST {path}", kind=SpanKind.SERVER,
            context=extract_context(dict(http.headers)) if http is not None else None,
            attributes={"http.request.method": "POST", "url.path": path, **attributes}), True

    async def _serve(self, body, ids: list[int], chat: bool, echo: str = "", http: Request | None = None,
                     plan=None, fmt=None, prompts: list[tuple[list[int], str]] | None = None,
                     entered_ns: int | None = None):
        """Run one request and answer it; ``plan`` (chat) adds stop tokens and a grammar, ``fmt`` replaces the
        response formatter (the Responses API's). ``prompts`` (completions with several prompts): ``(token ids,
        echo text)`` per prompt instead of ``ids``/``echo``, one engine request each, run at once, ``body.n``
        choices each (choice ``p * n + i``). Errors before every prompt's first item are HTTP errors;
        ``x-lane`` names the lane that served (``a,b`` when the prompts went to different lanes).
        ``entered_ns``: when the handler was entered (``time.time_ns()``), marked on the HTTP span with the
        time planning ended (:data:`~ops.telemetry.tracing.ATTR_INGRESS_HANDLER_NS`, ``..._PLANNED_NS``)."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        arrival = time.monotonic()
        planned = time.time_ns()
        span, owned = self._http_span(http, body, chat)
        if entered_ns is not None:
            span.set_attributes({ATTR_INGRESS_HANDLER_NS: entered_ns, ATTR_INGRESS_PLANNED_NS: planned})
        try:
            override = self._lane_override(http)
            prompts = prompts or [(ids, echo)]
            requests = [self._request(body, p_ids, plan) for p_ids, _ in prompts]
            for request in requests:
                request.lane_override = override
            span.set_attributes({ATTR_REQUEST_ID: ",".join(request.request_id for request in requests),
                                 ATTR_GEN_AI_INPUT_TOKENS: sum(len(p_ids) for p_ids, _ in prompts),
                                 ATTR_GEN_AI_MAX_TOKENS: requests[0].params.max_tokens})
            context = trace.set_span_in_context(span)
            # the engines send token ids; text and stop strings are made here (replicas.output_processor)
            streams = [with_text(self.router.generate(request, context, arrival), self.tokenizer, request.params)
                       for request in requests]
            merged = streams[0] if len(streams) == 1 else merge_prompt_streams(streams, body.n)
            stream = _traced(merged, span, owned)
        except OpenAIError as exc:
            if owned:
                span.set_attribute("http.response.status_code", exc.status)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.end()
            raise
        heads, started = [], set()  # the first items, until every prompt has started (or one failed)
        while len(started) < len(prompts):
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                await stream.aclose()
                raise OpenAIError("no output", status=500, type_="server_error") from None
            if isinstance(item, GenerationError):
                await stream.aclose()
                raise to_http(item)
            heads.append(item)
            started.add(item.index // body.n)
        lanes = list(dict.fromkeys(h.lane for h in sorted(heads, key=lambda h: h.index)))
        headers = {"x-lane": ",".join(lanes)}
        logprobs = requests[0].params.logprobs is not None
        if fmt is None and plan is not None:
            fmt = self.chat_planner.formatter(plan, self.model_name, self.token_text, logprobs)
        elif fmt is None:
            fmt = (ChatFormat(self.model_name, self.token_text, logprobs) if chat
                   else CompletionFormat(self.model_name, self.token_text, logprobs, [e for _, e in prompts], body.n,
                                         [p_ids for p_ids, _ in prompts]))
        first, rest = heads[0], _prepend(heads[1:], stream)
        batched = {"num_prompts": len(prompts)} if len(prompts) > 1 else {}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                fmt.sse(first, rest, body.n, include_usage, **batched), media_type="text/event-stream",
                headers=headers,
            )
        return JSONResponse(await fmt.collect(first, rest, body.n, **batched), headers=headers)


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(openai_api())
class OpenAIIngress(OpenAIFrontend):
    """The HTTP front door of the two-deployment topology: holds the tokenizer and the router, which sends each
    request to a replica deployment through its Serve handle (``persistent``/``standard``; co-located: the one
    pool's handle twice)."""

    def __init__(self, config: AppConfig, persistent, standard):
        self._start_frontend(config, persistent, standard)
