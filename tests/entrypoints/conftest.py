"""A kvlab server on the embedded model, started once per module in a background thread on a free port."""

import pytest
from serving_helpers import start_server


@pytest.fixture(scope="module")
def served():
    base, server, async_llm, thread = start_server(block_size=16, num_blocks=48, max_num_seqs=8,
                                                    max_num_batched_tokens=128)
    yield base, async_llm
    server.should_exit = True
    thread.join(10)
