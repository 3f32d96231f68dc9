"""`kvlab serve`'s flags have vLLM's spellings and refuse bad values with a message."""

import argparse
import subprocess
import sys

import pytest

from kvlab.entrypoints.cli import parse_bytes, serve_parser


def parse(*argv):
    return serve_parser(argparse.ArgumentParser()).parse_args(list(argv))


def test_vllm_spellings():
    args = parse("--block-size", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                 "--no-enable-prefix-caching", "--kv-cache-dtype", "int8", "--kv-cache-memory", "8MiB",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (8, 4, 64)
    assert args.enable_prefix_caching is False and args.kv_cache_dtype == "int8"
    assert args.kv_cache_memory == 8 * 2**20
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert parse().enable_prefix_caching is True and parse("--enable-prefix-caching").enable_prefix_caching


def test_served_model_name_as_vllm_spells_it():
    assert parse().served_model_name is None, "unset: the served name is the model argument (or kvlab-embedded)"
    assert parse("--served-model-name", "bard").served_model_name == ["bard"]
    assert parse("--served-model-name", "bard", "kvlab-embedded").served_model_name == ["bard", "kvlab-embedded"], (
        "vLLM's flag takes one or more names; answers carry the first")


def test_byte_counts():
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1G") == 2**30 and parse_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="byte count"):
        parse_bytes("lots")


@pytest.mark.parametrize("argv", [["--kv-cache-dtype", "int4"], ["--speculative-config", "{oops"],
                                  ["--speculative-config", "[1]"], ["--max-num-seqs", "many"]])
def test_bad_flags_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "error" in capsys.readouterr().err


def test_console_script_and_module_both_answer():
    for cmd in ([sys.executable, "-m", "kvlab.serve", "--help"],
                [sys.executable, "-c", "from kvlab.entrypoints.cli import main; main(['serve', '--help'])"]):
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "--max-num-batched-tokens" in run.stdout, run.stderr[-1000:]


def test_a_bad_engine_setting_is_refused_before_serving():
    run = subprocess.run([sys.executable, "-m", "kvlab.serve", "--num-blocks", "1", "--block-size", "4",
                          "--max-model-len", "9999"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "max_model_len" in run.stderr, run.stderr[-1000:]


def test_proxy_flags_and_a_bad_url_refused():
    from kvlab.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"])
    assert exit_.value.code == 2
    run = subprocess.run([sys.executable, "-m", "kvlab.entrypoints.cli", "proxy", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "--fallback-local-prefill" in run.stdout, run.stderr[-1000:]
