"""kv_transfer_config: every bad value raises naming its field, and the engine refuses what a connector cannot serve."""

import argparse
import json

import pytest

from conftest import make_tiny_hybrid_model
from kvlab.engine.config import EngineConfig
from kvlab.engine.llm_engine import LLMEngine
from kvlab.kv_transfer import KVConnectorBase_V1, KVConnectorFactory, KVConnectorRole, KVTransferConfig
from kvlab.kv_transfer.offloading_connector import OffloadingConnector

GOOD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_offloading_size": 1 << 20}}


def with_extra(**extra):
    return {**GOOD, "kv_connector_extra_config": {**GOOD["kv_connector_extra_config"], **extra}}


@pytest.mark.parametrize("value, field", [
    ({**GOOD, "kv_connector": "NixlConnector"}, "kv_connector"),
    ({**GOOD, "kv_role": "kv_sender"}, "kv_role"),
    ({**GOOD, "kv_connector_extra_config": [1]}, "kv_connector_extra_config"),
    ({"kv_role": "kv_both"}, "kv_connector"),
    ({**GOOD, "kv_buffer_size": 3}, "kv_buffer_size"),
    ("{not json", "kv_transfer_config"),
    (42, "kv_transfer_config"),
])
def test_bad_config_values_raise_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(kv_transfer_config=value)


def test_an_unknown_connector_lists_the_known_ones():
    with pytest.raises(ValueError, match="OffloadingConnector"):
        KVTransferConfig.from_value({"kv_connector": "nope"})


@pytest.mark.parametrize("extra, field", [
    ({"kv_offloading_size": None}, "kv_offloading_size"),
    ({"kv_offloading_size": -1}, "kv_offloading_size"),
    ({"kv_offloading_size": True}, "kv_offloading_size"),
    ({"kv_offloading_size": 100}, "kv_offloading_size"),   # less than one block
    ({"eviction_policy": "fifo"}, "eviction_policy"),
    ({"offload_prompt_only": "yes"}, "offload_prompt_only"),
    ({"kv_offload_size": 1}, "kv_offload_size"),
])
def test_bad_connector_settings_raise_naming_the_field(embedded, extra, field):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=field):
        LLMEngine(model, tokenizer, block_size=8, num_blocks=8, kv_transfer_config=with_extra(**extra))


def test_a_missing_offloading_size_is_named(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLMEngine(model, tokenizer, block_size=8, num_blocks=8,
                  kv_transfer_config={"kv_connector": "OffloadingConnector"})


def test_the_offloading_connector_needs_both_directions(embedded):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match="kv_role"):
        LLMEngine(model, tokenizer, block_size=8, num_blocks=8, kv_transfer_config={**GOOD, "kv_role": "kv_consumer"})


@pytest.mark.parametrize("knobs, named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(preemption_mode="swap"), "preemption_mode"),
    (dict(reservation_policy="max"), "reservation_policy"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
])
def test_the_engine_refuses_what_the_connector_cannot_serve(embedded, knobs, named):
    model, tokenizer = embedded
    with pytest.raises(ValueError, match=f"kv_transfer_config.*{named}"):
        LLMEngine(model, tokenizer, block_size=8, num_blocks=16, kv_transfer_config=GOOD, **knobs)


def test_the_engine_refuses_a_hybrid_model():
    model = make_tiny_hybrid_model("mistral", window=16)
    with pytest.raises(ValueError, match="kv_transfer_config.*sliding-window"):
        LLMEngine(model, None, block_size=8, num_blocks=16, kv_transfer_config=GOOD)


def test_json_string_and_command_line_give_the_same_config():
    from_dict = EngineConfig.from_kwargs(kv_transfer_config=GOOD).kv_transfer_config
    from_json = EngineConfig.from_kwargs(kv_transfer_config=json.dumps(GOOD)).kv_transfer_config
    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    from_cli = EngineConfig.from_cli_args(parser.parse_args(["--kv-transfer-config", json.dumps(GOOD)]))
    assert from_dict == from_json == from_cli.kv_transfer_config == KVTransferConfig(**GOOD)
    assert from_dict.is_kv_producer and from_dict.is_kv_consumer
    assert EngineConfig.from_kwargs().kv_transfer_config is None, "no connector unless asked"
    replaced = EngineConfig.from_kwargs().replace(kv_transfer_config=GOOD)
    assert replaced.kv_transfer_config == from_dict and replaced.as_kwargs()["kv_transfer_config"] == from_dict


def test_the_factory_builds_each_role_and_checks_role_calls():
    config = KVTransferConfig(**GOOD)
    assert KVConnectorFactory.get_connector_class("OffloadingConnector") is OffloadingConnector
    scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, block_size=8,
                                                    bytes_per_block=4096)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, block_size=8, bytes_per_block=4096)
    assert isinstance(scheduler, KVConnectorBase_V1) and scheduler.num_cpu_blocks == 256
    assert scheduler.manager is not None and worker.manager is None, "only the scheduler's half keeps the tier"
    with pytest.raises(RuntimeError, match="worker-side"):
        scheduler.bind_connector_metadata(None)
    with pytest.raises(RuntimeError, match="scheduler-side"):
        worker.build_connector_meta(None)
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("OffloadingConnector", "a:B")
