"""Chapter 7's grading guards: wild addresses stopped before they are touched, planted scores, inputs kept.

In Triton's interpreter on CPU, where a learner's kernel can read or write any address: without the
guard an unmasked load far past a tensor ends the process, and with it the whole notebook's grading.
"""

import importlib.util

import pytest
import torch

from kvlab.kernels.interpreter import RUNS_IN_INTERPRETER, triton, triton_language_as
from kvlab.kernels.load_counter import OutOfBounds, out_of_bounds_cause, refuse_out_of_bounds

pytestmark = pytest.mark.skipif(not RUNS_IN_INTERPRETER, reason="the guards watch the interpreter's loads and stores")
tl = triton.language


def fresh(name):
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kc = fresh("kvlab.course.kernel_checks")


@triton.jit
def copy_at(x_ptr, out_ptr, offset):
    lanes = tl.arange(0, 4)
    tl.store(out_ptr + lanes, tl.load(x_ptr + offset + lanes))


@triton.jit
def store_at(out_ptr, offset):
    lanes = tl.arange(0, 4)
    tl.store(out_ptr + offset + lanes, tl.zeros([4], tl.float32))


def test_a_load_far_outside_every_tensor_is_refused_before_it_is_read():
    x, out = torch.arange(8.0), torch.zeros(4)
    # triton_language_as: tl's own helpers in the interpreter's mode, whatever another test imported first.
    with triton_language_as(interpreted=True), refuse_out_of_bounds(x=x, out=out):
        copy_at[(1,)](x, out, 4)                       # lanes 4-7 of x: inside
        assert out.tolist() == [4.0, 5.0, 6.0, 7.0]
        with pytest.raises(Exception) as raised:
            copy_at[(1,)](x, out, 2**40)               # dereferenced, this address ends the process
    cause = out_of_bounds_cause(raised.value)
    assert isinstance(cause, OutOfBounds) and "a load had 4 lane(s)" in str(cause), (
        f"the interpreter's error should carry the refusal naming the load; got {raised.value!r}")


def test_a_store_just_before_a_tensor_is_refused_and_writes_nothing():
    pool = torch.ones(16)
    view = pool[4:]                                     # the kernel is given only this part
    with triton_language_as(interpreted=True), refuse_out_of_bounds(out=view), pytest.raises(Exception) as raised:
        store_at[(1,)](view, -1)                        # slot -1 written without a check
    assert out_of_bounds_cause(raised.value) is not None, "a store before the tensor must be refused"
    assert torch.equal(pool, torch.ones(16)), "the refused store must not have written anything"


def test_a_learner_kernel_reading_outside_its_tensors_fails_its_check_with_a_message():
    @triton.jit
    def by_position(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_key_tok, stride_key_head,
                    stride_value_tok, stride_value_head, stride_cache_block, stride_cache_slot, stride_cache_head,
                    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        tok = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + tok)
        dims = tl.arange(0, HEAD_DIM_PAD)
        # The slot used as an element offset into key: far past key's end for large slots.
        tl.store(k_cache_ptr + slot * stride_cache_slot + dims, tl.load(key_ptr + slot * 4096 + dims))

    with triton_language_as(interpreted=True), pytest.raises(kc.CheckFailed, match="outside every tensor passed"):
        kc.check_cache_write("wild", *kc.make_cache_write([40, 3]), kernel=by_position)


@pytest.mark.parametrize("peak, big, small", [("late", slice(16, None), slice(0, 16)),
                                               ("early", slice(0, 16), slice(16, None))])
def test_planted_scores_rise_hundreds_above_the_rest_where_asked(peak, big, small):
    q, k_cache, _, tables, _ = kc.make_batch([40], num_heads=2, num_kv_heads=1, peak=peak)
    keys = k_cache[tables[0, :5].long()].flatten(0, 1)[:40, 0]            # [40, head_dim] in position order
    scores = keys @ q[0, 0] * q.shape[-1] ** -0.5
    assert scores[big].max() > 88 + scores[small].max(), (
        f"peak={peak!r} must put scores more than 88 (where fp32's exp overflows) above all the others, so that a "
        f"stale or per-tile max fails; got {scores[big].max():.1f} against {scores[small].max():.1f}")


def test_a_kernel_that_writes_into_an_input_fails_its_check():
    @triton.jit
    def scribbles(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_key_tok, stride_key_head,
                  stride_value_tok, stride_value_head, stride_cache_block, stride_cache_slot, stride_cache_head,
                  NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        tl.store(slot_mapping_ptr + tl.program_id(0), -1)

    with triton_language_as(interpreted=True), pytest.raises(kc.CheckFailed, match="changed its input slot_mapping"):
        kc.check_cache_write("scribbles", *kc.make_cache_write([4, 9]), kernel=scribbles)


REACHED = {}  # a learner's namespace holding kvlab's reference under another name


@triton.jit
def borrows(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, stride_key_tok, stride_key_head,
            stride_value_tok, stride_value_head, stride_cache_block, stride_cache_slot, stride_cache_head,
            NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
            HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    REACHED["write"](None, None, None, None, None)  # the interpreter runs Python: a reference is in reach


def test_kvlab_s_reference_refuses_to_run_inside_a_checked_kernel():
    import kvlab.kernels

    REACHED["write"] = kvlab.kernels.reshape_and_cache_reference   # reached through a dict, not by name
    with triton_language_as(interpreted=True), pytest.raises(kc.CheckFailed, match="refuses to run"):
        kc.check_cache_write("borrows", *kc.make_cache_write([4, 9]), kernel=borrows)
