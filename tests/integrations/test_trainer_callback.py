"""DeltaSyncCallback with a real `transformers.Trainer` on CPU: every optimizer step becomes a store
version, bit-exact with the trainer's weights, and the stored config names the architecture."""

from __future__ import annotations

import json

import torch

from vllm_delta import DeltaStore, checksum, replay
from vllm_delta.integrations import DeltaSyncCallback
from vllm_delta.testing.models import TinyModelSpec
from vllm_delta.testing.training import bf16_image, build_master_model


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 16, seq: int = 16):
        gen = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def test_trainer_publishes_every_step(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build_master_model(TinyModelSpec(arch="qwen3", vocab_size=300), seed=3)
    model.config.architectures = None  # as `from_config` leaves a config built in code
    store_uri = str(tmp_path / "store")
    seen: dict[int, str] = {}

    class Recorder(DeltaSyncCallback):
        def _publish(self, model, step):  # the trainer's weights at each published step
            super()._publish(model, step)
            seen[step] = checksum(bf16_image(model))

    callback = Recorder(store_uri, anchor_every=2, every_n_steps=1)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=RandomTokens(300), callbacks=[callback]).train()
    store = DeltaStore(store_uri)
    assert store.versions() == [0, 1, 2, 3, 4]
    assert [store.record(v).kind for v in store.versions()] == ["anchor", "delta", "anchor", "delta", "anchor"]
    for v, want in seen.items():
        assert store.record(v).checksum == want
    version, tensors = replay(store, "latest")
    assert version == 4 and checksum(tensors) == checksum(bf16_image(model))
    assert json.loads(store.objects.get_asset("config.json"))["architectures"] == ["Qwen3ForCausalLM"]
    assert callback.publisher is None  # closed at the end of training (uploads flushed)


def test_every_n_steps_and_final_weights(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build_master_model(TinyModelSpec(vocab_size=300), seed=4)
    callback = DeltaSyncCallback(str(tmp_path / "store"), every_n_steps=2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=RandomTokens(300), callbacks=[callback]).train()
    store = DeltaStore(str(tmp_path / "store"))
    assert store.versions() == [0, 2, 4, 5]  # every 2 steps, and the final weights
    assert store.record(5).checksum == checksum(bf16_image(model))
