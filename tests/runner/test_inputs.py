"""Host-side input preparation, checked by hand on a small mixed step (no device)."""

import numpy as np
import pytest

from jaxserve.core import SamplingParams
from jaxserve.runner.inputs import RequestState, num_seqs_for_bucket, pick_bucket, prepare_inputs, token_buckets


def test_buckets_are_powers_of_two_up_to_the_budget():
    assert token_buckets(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert pick_bucket(1, [16, 32]) == 16 and pick_bucket(17, [16, 32]) == 32
    with pytest.raises(ValueError, match="33 tokens exceed the largest bucket 32"):
        pick_bucket(33, [16, 32])
    assert num_seqs_for_bucket(16, 64) == 16 and num_seqs_for_bucket(512, 64) == 64


def test_mixed_step_by_hand():
    decode = RequestState("d", token_ids=[10, 11, 12, 13, 14, 15], num_prompt_tokens=4, block_ids=[3, 7],
                          num_computed_tokens=5, sampling_params=SamplingParams(temperature=0.5, top_k=5, seed=9),
                          seed=9, eos_token_ids=(2,))
    chunk = RequestState("c", token_ids=[20, 21, 22, 23, 24], num_prompt_tokens=5, block_ids=[9, 4],
                         num_computed_tokens=0,
                         sampling_params=SamplingParams(min_tokens=2, stop_token_ids=[8], repetition_penalty=1.2),
                         seed=1, eos_token_ids=(2,))
    x = prepare_inputs([(decode, 1), (chunk, 3)], num_tokens_bucket=16, max_num_seqs=4, max_blocks_per_seq=3,
                       block_size=4, max_model_len=8, vocab_size=100)
    assert x.input_ids.tolist() == [15, 20, 21, 22] + [0] * 12
    assert x.positions.tolist() == [5, 0, 1, 2] + [0] * 12
    # position 5 of d -> block 7 offset 1 -> slot 29; c's positions 0..2 -> block 9 -> slots 36..38
    assert x.attn.slot_mapping.tolist() == [29, 36, 37, 38] + [0] * 12
    assert x.attn.block_tables.tolist() == [[3, 7, 0], [9, 4, 0], [0, 0, 0], [0, 0, 0]]
    assert x.attn.context_lens.tolist() == [6, 3, 0, 0]
    assert x.attn.query_start_loc.tolist() == [0, 1, 4, 4, 4]
    assert int(x.attn.num_seqs) == 2
    assert x.logits_indices.tolist() == [0, 3, 0, 0]
    s = x.sampling
    assert s.temperature.tolist() == [0.5, 1.0, 0, 0] and s.top_k.tolist() == [5, 0, 0, 0]
    assert s.sample_index.tolist() == [2, 0, 0, 0] and s.seeds.tolist() == [9, 1, 0, 0]
    assert s.repetition_penalty.tolist() == pytest.approx([1.0, 1.2, 1.0, 1.0])
    # Only the penalised row carries its token history.
    assert s.prompt_token_ids[1].tolist() == [20, 21, 22, 23, 24, -1, -1, -1]
    assert (s.prompt_token_ids[0] == -1).all() and (s.output_token_ids == -1).all()
    # c is under min_tokens: EOS and its stop token are banned; d is not.
    assert x.banned_token_ids[1, :2].tolist() == [2, 8] and (x.banned_token_ids[0] == -1).all()
    assert not bool(x.want_logprobs)
    assert x.input_ids.dtype == np.int32 and x.attn.block_tables.dtype == np.int32


def _worded(output, words, prompt=(50, 51, 52)):
    return RequestState("w", token_ids=[*prompt, *output], num_prompt_tokens=len(prompt), block_ids=[0],
                        num_computed_tokens=len(prompt) + len(output) - 1,
                        sampling_params=SamplingParams(bad_words_token_ids=words), seed=0)


@pytest.mark.parametrize("output,bans", [
    ([], [7]),                        # nothing generated: only the one-token word (the prompt never counts)
    ([9], [7, 10]),                   # the output is exactly a word's prefix
    ([3, 9], [7, 10]),
    ([9, 4], [5, 7]),                 # [9, 4] is the three-token word's prefix
    ([8, 9, 4], [5, 7]),
    ([9, 5], [7]),
    ([4], [7]),                       # the end of a prefix is not enough
])
def test_bad_word_bans_match_the_output_tail(output, bans):
    from jaxserve.runner.inputs import bad_word_bans

    words = [[7], [9, 10], [9, 4, 5]]
    assert sorted(bad_word_bans(_worded(output, words))) == bans
    # A prompt ending like a word's prefix bans nothing more (vLLM matches over the output only).
    assert sorted(bad_word_bans(_worded(output, words, prompt=(50, 9, 4)))) == bans


def test_bans_and_allowed_tokens_go_into_the_bitmask_rows():
    allowed = RequestState("a", token_ids=[5, 6], num_prompt_tokens=2, block_ids=[0], num_computed_tokens=1,
                           sampling_params=SamplingParams(allowed_token_ids=[3, 40, 63]), seed=0)
    x = prepare_inputs([(allowed, 1), (_worded([9], [[7], [9, 40]]), 1)], num_tokens_bucket=16, max_num_seqs=4,
                       max_blocks_per_seq=1, block_size=16, max_model_len=16, vocab_size=64)
    bits = np.unpackbits(x.token_bitmask.view(np.uint8), axis=1, bitorder="little")[:, :64].astype(bool)
    assert bool(x.use_bitmask)
    assert np.flatnonzero(bits[0]).tolist() == [3, 40, 63]
    assert np.flatnonzero(~bits[1]).tolist() == [7, 40] and bits[2:].all()


def test_rows_without_a_token_count_the_min_tokens_bans_and_only_the_vocabulary():
    from jaxserve.runner.inputs import rows_without_a_token, token_mask

    vocab, width = 70, 3
    rows = np.stack([token_mask([5, 9], width), token_mask([5, 9], width), token_mask([69], width),
                     token_mask([69], width), np.full(width, -1, np.int32)])
    rows[3] |= token_mask([70, 95], width)      # bits past the vocabulary (a word's padding) are no token
    rows[3] &= ~token_mask([69], width)
    banned = np.array([[5, -1], [5, 9], [-1, -1], [-1, -1], [0, 1]], np.int32)
    assert rows_without_a_token(rows, banned, vocab).tolist() == [False, True, False, True, False]
