"""Our responses, validated by the installed vLLM's own pydantic models (`make check-vllm-next`: vLLM 0.33).

A vLLM that reports spans itself (vLLM 0.33: `return_weight_versions`, `choices[i].weight_versions` as
`WeightVersionSpan` objects) is the contract: what our plugin's middleware sends must be what that
vLLM's own response models accept, across an in-flight update too, and must say what the engine did.
The chain runs on that vLLM's real objects, no engine: a real `Scheduler` (its KVCacheManager and
BlockPool) carries a request through a chunked prefill across an in-flight commit (engine_core/calls.py,
provenance.py), vLLM's own `RequestOutput`/`CompletionOutput`/`WeightVersionSpan` carry output spans
across the same commit into our generate() wrapper, vLLM's own response models build the bodies its
server would send (JSON and SSE, asked, unasked with the server option "always", and with vLLM's own
spans already written), our real ASGI middleware fills them, and vLLM's models validate the result.
Also: vLLM's paused refusal as its code writes it is what our clients retry, and vLLM's RL series count
our operations. Each test fails (never skips) on a vLLM without the span schema.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from vllm_delta.server_api import RETURN_WEIGHT_VERSIONS, from_wire, is_engine_paused, to_wire
from vllm_delta.vllm.api_server.spans import AttributionMiddleware, SpanPolicy, SpanStore, wrap_generate
from vllm_delta.vllm.engine_core import calls as enginecore
from vllm_delta.vllm.engine_core import provenance
from vllm_delta.vllm.shared.messages import PromptVersions

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_objects]

BLOCK = 16
PROMPT = list(range(10, 50))  # 40 tokens: three chunks of at most 16 tokens


def test_this_vllm_reports_spans_itself():
    """The contract below is the schema of a vLLM that has `return_weight_versions` (0.33 on)."""
    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponseChoice
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponseChoice

    for model in (CompletionRequest, ChatCompletionRequest):
        assert RETURN_WEIGHT_VERSIONS in model.model_fields, f"vLLM {vllm.__version__} has no {RETURN_WEIGHT_VERSIONS}"
    for choice in (CompletionResponseChoice, ChatCompletionResponseChoice):
        assert "weight_versions" in choice.model_fields


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real Scheduler of this vLLM (16-token chunks, prefix caching) behind a stand-in engine core whose
    workers answer every commit; our engine-core patches installed as the plugin installs them."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_delta.testing.models import TinyModelSpec, build_model, save_tiny_model

    model_dir = save_tiny_model(
        build_model(TinyModelSpec(num_kv_heads=1, vocab_size=500)), str(tmp_path_factory.mktemp("m")), weights=False
    )
    enginecore.install()
    cfg = EngineArgs(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=256,
        enforce_eager=True,
        block_size=BLOCK,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
    ).create_engine_config()
    cfg.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l.0.attn"], spec)])
    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)

    class Executor:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            return [{"apply_ms": 0.5}]

    scheduler = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK, log_stats=True)
    core = SimpleNamespace(
        vllm_config=cfg, scheduler=scheduler, model_executor=Executor(), batch_queue=None, _weight_version="3"
    )
    provenance.attach(core)
    return SimpleNamespace(core=core, hasher=get_request_block_hasher(BLOCK, hash_fn))


@pytest.fixture(scope="module")
def provenance_across_a_commit(engine) -> PromptVersions:
    """A 40-token prompt: two chunks on version 3, an in-flight commit to 4, the last chunk on 4."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    core = engine.core
    req = Request("cmpl-c-0-abcd1234", PROMPT, SamplingParams(max_tokens=8), None, block_hasher=engine.hasher)
    core.scheduler.add_request(req)
    core.scheduler.schedule()
    core.scheduler.schedule()
    reply = enginecore.write_between_steps(core, ticket="t", version=4, mode="inflight")
    assert "error" not in reply, reply
    core.scheduler.schedule()
    assert req.num_computed_tokens == len(PROMPT)
    spans = from_wire(PromptVersions, enginecore.prompt_versions(core, ids=["cmpl-c-0"])).spans["cmpl-c-0"]
    return PromptVersions({"cmpl-c-0": spans, "chatcmpl-c": spans})  # the chat request: the same prompt


def vllm_outputs(request_id: str):
    """What this vLLM's output processor hands generate()'s caller for a request that straddled the
    commit: its own RequestOutput, CompletionOutput and WeightVersionSpan objects."""
    from vllm.outputs import CompletionOutput, RequestOutput, WeightVersionSpan

    spans = [WeightVersionSpan("3", 0, 5), WeightVersionSpan("4", 5, 9)]
    out = CompletionOutput(
        index=0, text="x" * 9, token_ids=list(range(9)), cumulative_logprob=None, logprobs=None, finish_reason="length"
    )
    out.weight_versions = spans
    return RequestOutput(request_id, "p", PROMPT, None, [out], finished=True), spans


def through_middleware(path: str, body: bytes, content_type: bytes, chunks: list[bytes], policy: SpanPolicy, store):
    """One request through our real middleware in front of an app that answers `chunks`."""

    async def app(scope, receive, send):
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(
        AttributionMiddleware(app, store, policy)({"type": "http", "method": "POST", "path": path}, receive, send)
    )
    return b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture(scope="module")
def served(provenance_across_a_commit):
    """Our span store fed by vLLM's own outputs through our generate() wrapper, and the policy whose
    lookup answers what the engine core kept."""
    store = SpanStore()
    for rid in ("cmpl-c-0", "chatcmpl-c"):
        output, _ = vllm_outputs(rid)

        async def orig(prompt, sampling_params, request_id, output=output, **kw):
            yield output

        client = SimpleNamespace(generate=orig)
        wrap_generate(client, store)

        async def consume(client=client, rid=rid):
            return [o async for o in client.generate("p", SimpleNamespace(n=1), rid)]

        asyncio.run(consume())

    async def lookup(ids):
        return {i: provenance_across_a_commit.spans[i] for i in ids if i in provenance_across_a_commit.spans}

    return SimpleNamespace(store=store, lookup=lookup, prompt=provenance_across_a_commit)


ASKED = json.dumps({"model": "m", "prompt": "p", RETURN_WEIGHT_VERSIONS: True}).encode()
UNASKED = json.dumps({"model": "m", "prompt": "p"}).encode()
PROMPT_SPANS = [{"version": "3", "start": 0, "end": 32}, {"version": "4", "start": 32, "end": 40}]


def test_the_prompt_provenance_across_the_commit(served):
    assert to_wire(served.prompt.spans["cmpl-c-0"]) == PROMPT_SPANS


@pytest.mark.parametrize("case", ["asked", "always", "vllm_wrote_its_own"])
def test_completion_and_chat_bodies_validate(served, case):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.outputs import WeightVersionSpan

    _, spans = vllm_outputs("x")
    own = spans if case == "vllm_wrote_its_own" else None  # vLLM writes null unless asked
    policy = SpanPolicy(always=case == "always", prompt_versions=served.lookup)
    request = UNASKED if case == "always" else ASKED
    usage = UsageInfo(prompt_tokens=40, completion_tokens=9, total_tokens=49)
    completion = CompletionResponse(
        id="cmpl-c",
        model="m",
        choices=[CompletionResponseChoice(index=0, text="x" * 9, finish_reason="length", weight_versions=own)],
        usage=usage,
    )
    chat = ChatCompletionResponse(
        id="chatcmpl-c",
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0, message=ChatMessage(role="assistant", content="x"), finish_reason="length", weight_versions=own
            )
        ],
        usage=usage,
    )
    for path, response, model in (
        ("/v1/completions", completion, CompletionResponse),
        ("/v1/chat/completions", chat, ChatCompletionResponse),
    ):
        raw = json.dumps(response.model_dump()).encode()  # what vLLM's server sends (JSONResponse)
        body = through_middleware(path, request, b"application/json", [raw], policy, served.store)
        checked = model.model_validate(json.loads(body))  # vLLM's own model accepts our body
        choice = checked.choices[0]
        assert choice.weight_versions == [WeightVersionSpan("3", 0, 5), WeightVersionSpan("4", 5, 9)]
        assert json.loads(body)["choices"][0]["prefill_weight_versions"] == PROMPT_SPANS


def test_streamed_chunks_validate(served):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.outputs import WeightVersionSpan

    policy = SpanPolicy(prompt_versions=served.lookup)
    cases = (
        (
            "/v1/completions",
            CompletionStreamResponse,
            [
                CompletionStreamResponse(
                    id="cmpl-c", model="m", choices=[CompletionResponseStreamChoice(index=0, text="x", finish_reason=f)]
                )
                for f in (None, "length")
            ],
        ),
        (
            "/v1/chat/completions",
            ChatCompletionStreamResponse,
            [
                ChatCompletionStreamResponse(
                    id="chatcmpl-c",
                    model="m",
                    choices=[
                        ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="x"), finish_reason=f)
                    ],
                )
                for f in (None, "length")
            ],
        ),
    )
    for path, model, chunks in cases:
        events = [f"data: {c.model_dump_json(exclude_unset=True)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
        body = through_middleware(path, ASKED, b"text/event-stream", events, policy, served.store)
        parsed = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        final = model.model_validate(parsed[-1]).choices[0]
        assert final.weight_versions == [WeightVersionSpan("3", 0, 5), WeightVersionSpan("4", 5, 9)]
        assert parsed[-1]["choices"][0]["prefill_weight_versions"] == PROMPT_SPANS
        assert model.model_validate(parsed[0]).choices[0].weight_versions is None


def test_our_old_list_form_is_what_vllm_rejects():
    """Why the schema changed: the [[version, start, end]] lists earlier vllm-delta wrote under vLLM's key."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    body = {
        "id": "cmpl-c",
        "model": "m",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length", "weight_versions": [[3, 0, 5]]}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    with pytest.raises(ValidationError):
        CompletionResponse.model_validate(body)


def test_the_paused_refusal_as_this_vllm_writes_it_is_what_our_clients_retry():
    """This vLLM's engine core refusing a new request while paused (mode wait / abort), turned into the
    HTTP answer by its own error mapping: our clients' test recognizes it."""
    from http import HTTPStatus

    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.v1.engine.core import EngineCoreProc

    finished = []
    fake = SimpleNamespace(
        reject_new_requests=True,
        scheduler=SimpleNamespace(has_request=lambda rid: False),
        _send_finish_outputs_to_client=lambda ids, client, reason, error: finished.append(error),
    )
    request = SimpleNamespace(abort_immediately=False, request_id="r", client_index=0, kv_transfer_params=None)
    assert EngineCoreProc._reject_add_while_paused(fake, request) is True
    [error] = finished
    assert error.code == "engine_paused" and error.retryable
    body = create_error_response(error.to_exception()).model_dump()
    assert body["error"]["code"] == HTTPStatus.SERVICE_UNAVAILABLE.value
    assert is_engine_paused(503, body)  # the HTTP answer
    assert is_engine_paused(body["error"]["code"], body)  # the same error as a stream's event


def test_our_operations_are_counted_in_vllms_rl_series():
    from prometheus_client import REGISTRY

    from vllm_delta.vllm.api_server.metrics import vllm_operation

    def count(operation):
        value = REGISTRY.get_sample_value(
            "vllm:rl_weight_update_operation_duration_seconds_count", {"operation": operation}
        )
        return value or 0.0

    before = count("update"), count("stage")
    with vllm_operation("update"):
        in_flight = REGISTRY.get_sample_value("vllm:rl_weight_update_operations_in_flight", {"operation": "update"})
        assert in_flight == 1.0
    with pytest.raises(RuntimeError), vllm_operation("stage"):  # a failed operation is observed too, as vLLM does
        raise RuntimeError("store gone")
    assert (count("update"), count("stage")) == (before[0] + 1, before[1] + 1)
