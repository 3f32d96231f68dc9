"""A kvlab server on the embedded model, started once per module in a background thread on a free port."""

import pytest
from serving_helpers import start_server


@pytest.fixture(scope="module")
def served():
    server = start_server(block_size=16, num_blocks=48, max_num_seqs=8, max_num_batched_tokens=128)
    yield server.base_url, server.async_llm
    server.stop()
    assert not server.running, "the server thread must end on stop()"
