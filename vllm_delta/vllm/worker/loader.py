"""Load format "delta": start a server at a store version (anchor + replayed deltas).

    --load-format delta --model-loader-extra-config '{"delta_store": URI, "delta_version": "latest"}'

`--model` still names the directory with config.json and the tokenizer. The weights come from the
store: every tensor of the version is rebuilt on the host (the anchor's values with the chain's
deltas applied), checked against its header checksum and fed to the model's own `load_weights`,
exactly as vLLM's default loader feeds checkpoint shards. vLLM's post-processing is observed
(derived.py). Then the worker probes the layout (probe.py), refuses targets the post-processing
transformed or shadowed, checks the layout against vLLM's sparse path, and compares, tensor by tensor,
the live checksum of the loaded parameters over all ranks with the version's header: a server whose
live weights don't match what it loaded refuses to start, naming the tensor. With `delta_trusted_keys`,
every record of the start version's chain must be signed by a trusted key (shared/trust.py), checked
before any data file is read: else the server refuses to start (SignatureError naming the version).
A version that does not fit the model (another shape: the model's loader fails; another dtype: the
probed parameters say so) is refused with a message that names the store, the version and the tensor.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ...checksums import combine, to_hex
from ...errors import ChecksumMismatchError, DeltaError, ShapeMismatchError, VersionNotFoundError
from ...reconstruct import iter_version, open_chain, replay_tensor
from ..postprocess.derived import install_hook
from ..shared.eplb import refuse_eplb
from ..shared.options import LoaderOptions, split_extra_config
from ..shared.trust import check_start
from .replica import REPLICA_ATTR, DeltaReplica, Served

log = logging.getLogger(__name__)


class DeltaModelLoader(DefaultModelLoader):
    def __init__(self, load_config):
        ours, rest = split_extra_config(load_config.model_loader_extra_config)
        self.options = LoaderOptions.from_extra_config(ours)
        # The base class sees a safetensors load with only the keys it knows.
        super().__init__(dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config=rest))
        install_hook()  # observe vLLM's post-processing (derived.py); register() installs it too
        self._store = None
        self._files = None
        self._current: tuple[str, torch.Tensor] | None = None  # the tensor the model's loader got last

    @property
    def store(self):
        if self._store is None:
            self._store = self.options.store.open()
        return self._store

    def _chain(self):
        if self._files is None:
            version = self._start_version()
            records = self.store.chain(version, fresh=True)
            # delta_trusted_keys: the whole chain signed by a trusted key, of one run, before any file is read
            check_start(self.options.store.trust(), records, f"store {self.store.uri}")
            self._files = open_chain(self.store, version, records=records)
            log.info("vllm-delta: loading version %d from %s (%d files)", version, self.store.uri, len(self._files))
        return self._files

    def _start_version(self) -> int:
        """The configured version; "latest" is the newest one not marked bad, nor built on one (a server
        restarted on a store whose newest version was marked must not serve it)."""
        if self.options.version != "latest":
            return self.store.resolve(self.options.version)
        newest, usable = self.store.latest(), self.store.latest_usable()
        if usable is None:
            what = (
                "no version yet"
                if newest is None
                else f"no usable version: every chain up to {newest} passes one marked bad"
            )
            raise VersionNotFoundError(f"store {self.store.uri} holds {what}")
        if usable != newest:
            log.warning(
                "vllm-delta: %s: newest version %s is marked bad or built on one; loading %d",
                self.store.uri,
                newest,
                usable,
            )
        return usable

    def download_model(self, model_config) -> None:
        self._chain()  # downloads remote version files into the cache

    def get_all_weights(self, model_config, model):
        for name, tensor in iter_version(self._chain()):
            self._current = (name, tensor)
            yield name, tensor
        self._current = None

    def load_weights(self, model, model_config) -> None:
        try:
            super().load_weights(model, model_config)
        except DeltaError:
            raise
        except Exception as exc:
            # The model's own loader failed (a shape that does not fit, a name it does not know): say which
            # store, version and tensor, not only the loader's raw tensor-size error.
            where = f"version {self._files[-1].version} of store {self.store.uri}" if self._files else self.store.uri
            what = ""
            if self._current is not None:
                name, t = self._current
                what = f" at tensor {name!r} ({str(t.dtype).replace('torch.', '')}{list(t.shape)})"
            raise ShapeMismatchError(
                f"{where} does not fit this model{what}: {type(exc).__name__}: {str(exc)[:500]}"
            ) from exc

    def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
        refuse_eplb(vllm_config, "to start with --load-format delta")  # before any file is read
        model = super().load_model(vllm_config, model_config, prefix=prefix)
        files = self._chain()
        header = files[-1].header
        t0 = time.perf_counter()
        replica = DeltaReplica(model)
        try:
            fallback = replica.probe_layout(
                header.tensors.shape_map(),
                validate=self.options.validate,
                force_fallback=self.options.fallback,
            )
        except ShapeMismatchError as exc:  # the model's loader took it (e.g. narrowed it), the layout did not
            where = f"version {header.version} of store {self.store.uri}"
            raise ShapeMismatchError(f"{where} does not fit: {exc}") from None
        assert replica.fallback is not None and replica.engine is not None
        try:
            replica.engine.check_header(header)  # dtypes (the model's loader converts silently)
        except DeltaError as exc:
            raise ShapeMismatchError(
                f"version {header.version} of store {self.store.uri} does not fit: {exc}"
            ) from None
        for name in fallback:
            replica.fallback.set_shadow(name, replay_tensor(files, name))
        replica.served = Served.from_header(header)
        # Per tensor first (names the tensor: a re-packed parameter, a loader that is not a plain copy).
        sums = replica.verify_loaded(replica.served.sums, ChecksumMismatchError, "the version's header records")
        live = to_hex(combine(sums.items()))
        if live != header.checksum:
            raise ChecksumMismatchError(
                f"the loaded parameters have checksum {live}, the version's header records {header.checksum}",
                version=header.version,
            )
        setattr(model, REPLICA_ATTR, replica)
        log.info(
            "vllm-delta: serving version %d, live checksum %s verified (%.0f ms)",
            header.version,
            live,
            (time.perf_counter() - t0) * 1e3,
        )
        self._files = None  # release the memory maps
        return model
