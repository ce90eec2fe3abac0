"""TRL's `GRPOTrainer` with vllm-delta rollout servers: weight sync through the store, no NCCL.

The change a TRL user makes (tested with TRL 1.16.0):

    from vllm_delta.integrations.trl import DeltaGRPOTrainer as GRPOTrainer
    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=URL, ...), train_dataset=ds, delta="s3://bucket/run1")

The rollout server is vLLM's OpenAI server with the vllm-delta plugin, started from the store
(docs/DEPLOY.md). Everything else is TRL's: its `VLLMGeneration` (prompts gathered on the main
process, `/v1/completions` with token ids, completions broadcast to every rank), its importance
sampling correction with the server's logprobs, its loss. What changes is the one thing TRL 1.16
cannot do without a CUDA device and a network path to the server's workers: `sync_weights`. TRL's
server mode builds an NCCL group with the server (`VLLMClient.init_communicator`, which refuses a
non-CUDA device) and streams every parameter over it. Here each sync publishes the policy to the
store as version `global_step` (a sparse delta; every rank of a sharded trainer publishes its own
part), makes the servers live on it (`RolloutSyncOptions.mode`: "push" asks them to apply it,
"follow" waits until their followers did), and checks each server's live checksum against the
trainer's bf16 weights (`integrations/rollout_sync.py`).

The client asks every completion for the versions that produced it (`"return_weight_versions": true`,
vLLM 0.33's flag, which a vllm-delta server honours on vLLM 0.32 too; `choices[i].weight_versions`,
vllm_delta.attribution) and checks them: completions from any other version than the one just synced
(a server rolled back, a second publisher on the store, a server without the plugin) raise
`AttributionError` on every rank before the trainer scores them. vLLM 0.33 answers a generation request
with a retryable 503 (`engine_paused`) while it is paused in mode `wait` or `abort`: the client retries
it until its `connection_timeout` has passed.

What it relies on in TRL 1.16: `GRPOTrainer.__init__` building `VLLMGeneration` only when
`args.use_vllm` (so the trainer is built with it off and `DeltaVLLMGeneration` is attached after,
with the same arguments TRL passes), `VLLMGeneration._init_vllm`/`sync_weights`/`generate`, and
`VLLMClient._get`/`_post` and its `session` (every HTTP call of its generation goes through them).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from ..attribution import attribution_of, request_weight_versions
from ..server_api import is_engine_paused
from .rollout_sync import RolloutSync, RolloutSyncError, RolloutSyncOptions, SyncRecord, default_group

log = logging.getLogger(__name__)

TESTED_TRL = ("1.16.0",)  # the TRL versions this integration was tested with (docs/DEPLOY.md, "TRL")
COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
PAUSED_RETRY_S = 0.1  # between retries of a request vLLM refused while paused (503 engine_paused)


def warn_if_untested() -> None:
    """One warning when the installed TRL is not a version this integration was tested with: it relies
    on a few of TRL's internals (module docstring)."""
    import trl

    if trl.__version__ not in TESTED_TRL:
        log.warning(
            "vllm-delta: TRL %s is installed; the TRL integration was tested with %s only",
            trl.__version__,
            ", ".join(TESTED_TRL),
        )


class AttributionError(RolloutSyncError):
    """Completions came from a version the trainer did not sync (or carry no version at all)."""


class DeltaVLLMClient(VLLMClient):
    """TRL's server-mode client without the NCCL communicator, checking which weights produced every
    completion (`expect(version)`, `take_violation()`). `api_key`: vLLM's `--api-key`, sent with
    every call (TRL's client sends none)."""

    def __init__(self, base_url: str, *, connection_timeout: float = 240.0, api_key: str | None = None):
        self._api_key = api_key
        self.paused_wait_s = connection_timeout  # how long a request refused while paused is retried
        self.paused_retries = 0
        self.expected: int | None = None
        self.attributed: Counter[int | str] = Counter()  # completions per producing version
        self._violation: str | None = None
        super().__init__(base_url=base_url, connection_timeout=connection_timeout)
        self._generation = _session_leaving_503(self.session)

    def init_communicator(self, device: Any = 0) -> None:
        raise RuntimeError("vllm-delta syncs weights through its store: there is no NCCL communicator to open")

    def expect(self, version: int) -> None:
        """From now on every completion must come from `version` alone."""
        self.expected = version

    def take_violation(self) -> str | None:
        """The first completion since the last call that did not come from the expected version."""
        violation, self._violation = self._violation, None
        return violation

    def _get(self, url: str, **kwargs: Any) -> dict:
        return super()._get(url, **self._with_auth(kwargs))

    def _post(self, url: str, **kwargs: Any) -> dict:
        if not url.endswith(COMPLETION_ROUTES):
            return super()._post(url, **self._with_auth(kwargs))
        if isinstance(kwargs.get("json"), dict):
            kwargs["json"] = request_weight_versions(kwargs["json"])
        response = self._post_while_paused(url, **self._with_auth(kwargs))
        self._check(url, response)
        return response

    def _post_while_paused(self, url: str, **kwargs: Any) -> dict:
        """TRL's `_post`, retrying vLLM's 503 `engine_paused` until `paused_wait_s` has passed."""
        give_up = time.monotonic() + self.paused_wait_s
        while True:
            response = self._generation.post(url, **kwargs)
            if response.status_code != 503 or time.monotonic() >= give_up or not is_engine_paused(503, _json(response)):
                break
            self.paused_retries += 1
            time.sleep(PAUSED_RETRY_S)
        if response.status_code != 200:
            raise Exception(f"Request failed: {response.status_code}, {response.text}")  # as TRL's _post
        return response.json()

    def _with_auth(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._api_key:
            kwargs["headers"] = {**kwargs.get("headers", {}), "Authorization": f"Bearer {self._api_key}"}
        return kwargs

    def _check(self, url: str, response: dict) -> None:
        for choice in response.get("choices", ()):
            attribution = attribution_of(choice)
            if attribution is None:
                self._note(f"{url} returned a completion without weight_versions: is it a vllm-delta server?")
                continue
            versions = set(attribution.versions)
            for v in versions:
                self.attributed[v] += 1
            if self.expected is None or versions != {self.expected}:
                self._note(
                    f"a completion from {url} was produced by versions {sorted(map(str, versions))}, but the "
                    f"trainer synced version {self.expected}: it is not trained on"
                )

    def _note(self, message: str) -> None:
        if self._violation is None:
            self._violation = message


def _session_leaving_503(trl_session: Any) -> Any:
    """A session for generation requests with the retries of TRL's own session, but for a 503: TRL's
    retries it blindly (5 times, backing off 2 s, 4 s, 8 s, ...); here the body decides (a paused
    engine is retried until the deadline, anything else is the answer)."""
    import requests
    from requests.adapters import HTTPAdapter

    session = requests.Session()
    retry = trl_session.get_adapter("http://").max_retries
    forced = frozenset(retry.status_forcelist or ()) - {503}
    for scheme in ("http://", "https://"):
        session.mount(scheme, HTTPAdapter(max_retries=retry.new(status_forcelist=forced)))
    return session


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


class DeltaVLLMGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` in server mode, with the weight sync going through the store.

    `sync`: the RolloutSync (every rank has one). `version_fn`: the version of the next sync (the
    trainer's `global_step`). The server's `--api-key`, if any, is `sync.options.api_key`."""

    vllm_client: DeltaVLLMClient  # the main process's

    def __init__(self, *, sync: RolloutSync, version_fn: Callable[[], int], **kwargs: Any):
        self.sync = sync
        self.version_fn = version_fn
        self.synced: list[SyncRecord] = []  # every sync of this trainer, in order
        super().__init__(**kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "server":
            raise ValueError(f"vllm-delta generates on vLLM servers: vllm_mode must be 'server', not {self.mode!r}")
        if self.accelerator.is_main_process:
            self.vllm_client = DeltaVLLMClient(
                self.base_url, connection_timeout=self.server_timeout, api_key=self.sync.options.api_key
            )
        self.accelerator.wait_for_everyone()

    @property
    def base_url(self) -> str:
        if self.server_base_url is not None:
            return self.server_base_url.rstrip("/")
        return f"http://{self.server_host}:{self.server_port}"

    def sync_weights(self) -> None:
        """Publish the policy as version `version_fn()` and make the servers live on it (every rank)."""
        version = self.version_fn()
        record = self.sync.sync(self.model, version)
        self.synced.append(record)
        if self.accelerator.is_main_process:
            self.vllm_client.expect(version)
        log.info("vllm-delta: servers live on version %d (%s)", version, record.kind or "from the store")

    def generate(self, *args: Any, **kwargs: Any) -> tuple:
        out = super().generate(*args, **kwargs)
        violation = self.vllm_client.take_violation() if self.accelerator.is_main_process else None
        box = [violation]
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(box, from_process=0)
        if box[0] is not None:
            raise AttributionError(box[0])
        return out


class _FinalSync(TrainerCallback):
    """When training ends: sync the final weights (TRL syncs before each generation, so the last
    optimizer step is not on the servers yet), then wait for the uploads in flight."""

    def __init__(self, generation: DeltaVLLMGeneration):
        self.generation = generation

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001 - transformers' API
        synced = self.generation.synced
        try:
            if not synced or synced[-1].version != state.global_step:
                self.generation.sync_weights()
        finally:
            self.generation.sync.close()


class DeltaGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose vLLM server mode syncs weights through a vllm-delta store.

    Takes GRPOTrainer's arguments, with `GRPOConfig(use_vllm=True, vllm_mode="server")`, plus
    `delta`: the store URI (each version is pushed to the server), or `RolloutSyncOptions` (mode
    push|follow, timeouts, more servers).
    `RolloutSyncOptions.api_key`: the servers' `--api-key` (generation and sync both send it).
    `trainer.vllm_generation.synced` lists every sync;
    the last one, when training ends, puts the final weights on the servers."""

    def __init__(self, *args: Any, delta: str | RolloutSyncOptions, **kwargs: Any):
        bound = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if config is None or not config.use_vllm or config.vllm_mode != "server":
            raise ValueError(
                "DeltaGRPOTrainer generates on vLLM servers: pass args=GRPOConfig(use_vllm=True, vllm_mode='server', "
                "vllm_server_base_url=...)"
            )
        warn_if_untested()
        options = delta if isinstance(delta, RolloutSyncOptions) else RolloutSyncOptions(store=delta)
        # TRL builds its NCCL-synced VLLMGeneration in __init__ when use_vllm is on: build without it,
        # then attach ours with the arguments TRL passes (trl/trainer/grpo_trainer.py, 1.16).
        config.use_vllm = False
        try:
            super().__init__(*args, **kwargs)
        finally:
            config.use_vllm = True
        self.use_vllm = True
        from accelerate.utils import is_peft_model

        if is_peft_model(self.model):
            raise NotImplementedError("DeltaGRPOTrainer publishes full weights: PEFT adapters are not supported yet")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction:
            if self.vllm_importance_sampling_mode not in ["token_truncate", "token_mask"]:
                raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask'")
        a = self.args
        server = a.vllm_server_base_url or f"http://{a.vllm_server_host}:{a.vllm_server_port}"
        self.delta_sync = RolloutSync(options, servers=[server], group=default_group())
        self.vllm_generation = DeltaVLLMGeneration(
            sync=self.delta_sync,
            version_fn=lambda: self.state.global_step,
            model=self.model,
            accelerator=self.accelerator,
            processing_class=self.processing_class,
            mode="server",
            structured_outputs_regex=a.vllm_structured_outputs_regex,
            server_base_url=a.vllm_server_base_url,
            server_host=a.vllm_server_host,
            server_port=a.vllm_server_port,
            server_timeout=a.vllm_server_timeout,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_completion_length=self.max_completion_length,
            logprobs=0,  # the sampled tokens' logprobs, for TRL's importance sampling correction
            generation_kwargs=a.generation_kwargs,
        )
        self._last_loaded_step = -1
        self.add_callback(_FinalSync(self.vllm_generation))


__all__ = [
    "AttributionError",
    "DeltaGRPOTrainer",
    "DeltaVLLMClient",
    "DeltaVLLMGeneration",
    "RolloutSyncOptions",
]
