"""One configuration for LLM, LLMEngine and `kvlab serve`: each knob declared once, checked once, one flag each."""

import argparse
import dataclasses

import pytest

from kvlab import LLM
from kvlab.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvlab.entrypoints.cli import serve_parser
from kvlab.spec_decode.config import SpeculativeConfig


def parse(*argv):
    return serve_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_flat_knobs_land_in_their_part():
    config = EngineConfig.from_kwargs(block_size=8, num_blocks=40, max_num_seqs=3, kv_cache_dtype="fp8", seed=5,
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (config.cache_config.block_size, config.cache_config.num_blocks) == (8, 40)
    assert config.cache_config.kv_cache_dtype == "fp8_e4m3", "vLLM's 'fp8' is e4m3"
    assert config.scheduler_config.max_num_seqs == 3 and config.model_config.seed == 5
    assert isinstance(config.speculative_config, SpeculativeConfig)
    assert config.speculative_config.prompt_lookup_min == config.speculative_config.prompt_lookup_max == 5
    assert EngineConfig.from_kwargs(**config.as_kwargs()) == config, "as_kwargs gives back what from_kwargs takes"


def test_defaults_are_vllms_where_vllm_has_the_knob():
    config = EngineConfig()
    assert config.cache_config.block_size == 16 and config.cache_config.enable_prefix_caching is True
    assert config.scheduler_config.preemption_mode == "recompute" and config.speculative_config is None
    assert config.cache_config.kv_cache_dtype == "auto" and config.cache_config.attention_backend == "auto"


@pytest.mark.parametrize("knobs, message", [
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(num_blocks=-2), "num_blocks"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory must be an integer number of bytes"),
    (dict(kv_cache_dtype="int4"), "unsupported kv_cache_dtype 'int4'"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(attention_backend="cuda"), "attention_backend must be one of auto, reference, torch, triton"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens"),
    (dict(preemption_mode="drop"), "preemption_mode must be one of recompute, swap"),
    (dict(reservation_policy="orca"), "reservation_policy must be one of max, pow2, oracle"),
    (dict(dtype="float64"), "dtype must be one of auto, float32, float16, bfloat16"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(seed=-1), "seed"),
    (dict(num_blocks=4, kv_cache_memory=10**6), "not both"),
    (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}), "method must be one of"),
    (dict(block_sise=16), "unknown engine setting block_sise; kvlab knows"),
])
def test_every_bad_knob_is_refused_by_name(knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**knobs)


def test_the_old_decode_backend_name_still_works_with_a_message():
    with pytest.warns(DeprecationWarning, match="decode_backend is now called attention_backend"):
        config = EngineConfig.from_kwargs(decode_backend="torch")
    assert config.cache_config.attention_backend == "torch"
    with pytest.raises(ValueError, match="give attention_backend only"):
        EngineConfig.from_kwargs(decode_backend="torch", attention_backend="torch")


def test_replace_checks_again_and_keeps_the_rest():
    config = EngineConfig.from_kwargs(block_size=8, max_num_seqs=2)
    changed = config.replace(max_num_seqs=4)
    assert changed.scheduler_config.max_num_seqs == 4 and changed.cache_config.block_size == 8
    assert config.scheduler_config.max_num_seqs == 2, "a config is a value: replace returns a copy"
    with pytest.raises(ValueError, match="max_num_seqs"):
        config.replace(max_num_seqs=0)


def test_every_knob_has_one_flag_with_its_default_and_help():
    """The CLI is derived from the declarations: a knob added to a part is a flag of `kvlab serve` at once."""
    parser = serve_parser(argparse.ArgumentParser())
    flags = {a.dest: a for a in parser._actions}
    for part in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(part):
            if not f.metadata.get("flag", True):
                continue
            assert f.name in flags, f"{f.name} has no --{f.name.replace('_', '-')} flag"
            action = flags[f.name]
            assert action.default == f.default, f"--{f.name.replace('_', '-')} defaults to {action.default!r}"
            assert f.metadata["help"] in action.help, f"--{f.name.replace('_', '-')} must show the knob's help"
    assert EngineConfig.from_cli_args(parse()) == EngineConfig(), "no flags: the same defaults as LLM()"


def test_the_command_line_and_the_python_api_build_the_same_config():
    args = parse("--block-size", "8", "--num-blocks", "40", "--kv-cache-dtype", "int8", "--no-enable-prefix-caching",
                 "--max-num-seqs", "4", "--preemption-mode", "swap", "--num-cpu-blocks", "6",
                 "--attention-backend", "torch", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}')
    python = EngineConfig.from_kwargs(block_size=8, num_blocks=40, kv_cache_dtype="int8", enable_prefix_caching=False,
                                      max_num_seqs=4, preemption_mode="swap", num_cpu_blocks=6,
                                      attention_backend="torch",
                                      speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                          "prompt_lookup_min": 1})
    assert EngineConfig.from_cli_args(args) == python


def test_bad_knobs_are_refused_before_any_model_is_loaded(monkeypatch):
    import kvlab.model.loader

    monkeypatch.setattr(kvlab.model.loader, "load_model", lambda *a, **k: pytest.fail("loaded a model for nothing"))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="unknown engine setting"):
        LLM(max_num_seq=4)


def test_the_engine_reads_its_knobs_from_the_config(embedded):
    model, tokenizer = embedded
    llm = LLM(model, tokenizer, block_size=8, num_blocks=20, max_num_seqs=2, max_num_batched_tokens=24)
    engine = llm.llm_engine
    assert engine.config.cache_config.block_size == engine.block_size == engine.kv_cache_manager.block_size == 8
    assert engine.num_blocks == engine.kv_cache_manager.num_blocks == engine.cache.num_blocks == 20
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (2, 24)
    same = LLM(model, tokenizer, config=engine.config).llm_engine
    assert same.config == engine.config and same.num_blocks == 20
