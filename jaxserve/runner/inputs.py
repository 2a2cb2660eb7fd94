"""Host-side input preparation: a SchedulerOutput's requests -> padded numpy step inputs.

Runs on the engine thread before each step, with no device work: the result is a
`StepInputs` pytree of numpy arrays whose shapes depend only on the token bucket, so the
jitted step never recompiles after warm-up. Testable without a device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.core import MAX_LOGIT_BIAS, SamplingParams
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.runner.sampler import SamplingMetadata

# EOS + stop token ids masked while a request is under min_tokens: room for 8 EOS ids and the
# default --max-stop-token-ids (128). The step's ban is one scatter of [rows, MAX_BANNED] ids, as
# cheap at 136 as at 8 (64 x 49,152 logits: within 0.2 ms either way, in the noise).
MAX_BANNED = 136
PENDING = -1     # a token id a step in flight samples: the next step reads it from that step's output


@dataclasses.dataclass
class RequestState:
    """What the runner keeps per request between steps (built from NewRequestData, updated by diffs)."""

    req_id: str
    token_ids: list[int]                 # prompt + generated tokens, including the last sampled one
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int             # tokens in the cache before the current step
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    pending_row: int = -1                # while token_ids ends with PENDING: its row in the step sampling it
    allowed_mask: np.ndarray | None = None   # [ceil(V / 32)] int32 of allowed_token_ids, made on first use

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    input_ids: jax.Array         # [T] int32 token ids of the flat batch (padding 0)
    prev_rows: jax.Array         # [T] int32 for a token a step in flight samples (PENDING in input_ids): its
                                 # row of that step's sampled tokens, which the step reads on the device; else -1
    positions: jax.Array         # [T] int32 absolute position of each token (padding 0)
    logits_indices: jax.Array    # [R] int32 flat index of each sampling row's token (padding 0): a sequence's
                                 # last scheduled token, and with drafts the last real token and each draft
    num_rows: jax.Array          # [] int32 sampling rows in use (rows past it are padding: their logits may be 0)
    banned_token_ids: jax.Array  # [R, MAX_BANNED] int32 ids masked for rows under min_tokens (padding -1)
    want_logprobs: jax.Array     # [] bool: some row asked for logprobs (the sampled token's, top-N)
    token_bitmask: jax.Array     # [R, ceil(V / 32)] int32 allowed tokens (structured output); all ones unconstrained
    use_bitmask: jax.Array       # [] bool: some row is constrained (else the mask is not applied at all)
    bias_token_ids: jax.Array    # [R, MAX_LOGIT_BIAS] int32 token ids whose logits get a bias (padding -1)
    bias_values: jax.Array       # [R, MAX_LOGIT_BIAS] f32 the bias added to each (padding 0)
    use_bias: jax.Array          # [] bool: some row has a logit_bias (else no bias is added at all)
    attn: AttentionMetadata
    sampling: SamplingMetadata


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobsInputs:
    """Extra inputs of the step variant run only when some request of the step wants prompt logprobs."""

    next_token_ids: jax.Array    # [T] int32 prompt token after each flat position whose logprob is wanted (else 0)
    want_top: jax.Array          # [] bool: some request asked for a top-N (prompt_logprobs > 0)


@functools.lru_cache(maxsize=32)
def _minus_ones(rows: int, cols: int) -> np.ndarray:
    """A shared read-only [rows, cols] int32 array of -1: no tokens (padding), or as a bitmask every token allowed."""
    a = np.full((rows, cols), -1, np.int32)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=32)
def _zeros(rows: int, cols: int) -> np.ndarray:
    """A shared read-only [rows, cols] float32 array of zeros (no bias)."""
    a = np.zeros((rows, cols), np.float32)
    a.flags.writeable = False
    return a


def _word_and_bit(token_ids) -> tuple[np.ndarray, np.ndarray]:
    """Each token's word in the bitmask's layout (token 32 i + j: word i) and its bit there (1 << j, uint32)."""
    ids = np.asarray(token_ids, np.int64)
    return ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))


def token_mask(token_ids, width: int) -> np.ndarray:
    """[width] int32 with bit j of word i set for each token 32 i + j in `token_ids` (the bitmask's layout)."""
    words = np.zeros(width, np.uint32)
    np.bitwise_or.at(words, *_word_and_bit(token_ids))
    return words.view(np.int32)


def rows_without_a_token(bitmask: np.ndarray, banned: np.ndarray, vocab_size: int) -> np.ndarray:
    """[R] bool: the rows whose bitmask, less their min_tokens bans (`banned` [R, B], -1 padding),
    allows no token of the vocabulary (sampling such a row would pick an arbitrary token)."""
    words = bitmask.view(np.uint32).copy()
    rows, cols = np.nonzero(banned >= 0)
    word, bit = _word_and_bit(banned[rows, cols])
    np.bitwise_and.at(words, (rows, word), ~bit)
    if vocab_size % 32:
        words[:, vocab_size // 32] &= np.uint32((1 << vocab_size % 32) - 1)
    return ~words[:, :-(-vocab_size // 32)].any(axis=1)


def bad_word_bans(st: RequestState) -> list[int]:
    """The tokens a request's bad words ban at its next token: each sequence's last token, where the
    output so far ends with the rest of it (always, for a one-token word), as vLLM does."""
    bans, output = [], None
    for word in st.sampling_params.bad_words_token_ids:
        if len(word) > 1:
            if output is None:
                assert st.token_ids[-1] != PENDING, f"request {st.req_id} needs its last token on the host (bad words)"
                output = st.token_ids[st.num_prompt_tokens:]
            if len(output) < len(word) - 1 or output[len(output) - len(word) + 1:] != word[:-1]:
                continue
        bans.append(word[-1])
    return bans


def token_buckets(max_num_batched_tokens: int, smallest: int = 1) -> list[int]:
    """Power-of-two token counts up to the budget (the budget itself always included)."""
    buckets, b = [], smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_batched_tokens]


# Below this many tokens a step costs about the same whatever its size (it streams the
# weights once; on these CPUs compute catches up at ~16 rows in bfloat16, later on GPUs).
_CHEAP_TOKENS = 16


def first_buckets(buckets: list[int], up_to: int) -> list[int]:
    """The buckets compiled before serving, of those up to `up_to` tokens: the smallest, the
    first with at least 16 tokens, and every second one counted down from the largest above
    that (1..64 -> 1, 16, 64; 1..512 -> 1, 16, 32, 128, 512). Until the others compile, a
    step pads to the next of these: under 4x its tokens above 16, up to 16 tokens below."""
    small = [b for b in buckets if b <= up_to] or buckets[:1]
    cheap = next((b for b in small if b >= _CHEAP_TOKENS), small[-1])
    return sorted({small[0], cheap, *(b for b in small[::-2] if b > cheap)})


def later_buckets(buckets: list[int], first: list[int]) -> list[int]:
    """The order the buckets not in `first` compile in the background: those above the largest
    ready one first (each raises the step's budget cap), then the gaps below it (they only save
    padding), each part smallest first."""
    rest = [b for b in buckets if b not in first]
    top = max(first, default=0)
    return [b for b in rest if b > top] + [b for b in rest if b < top]


def pick_bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {buckets[-1]}")


def num_seqs_for_bucket(num_tokens_bucket: int, max_num_seqs: int) -> int:
    """Sequences can never outnumber tokens, so small buckets carry fewer sequence rows."""
    return min(num_tokens_bucket, max_num_seqs)


def num_prompt_logprob_positions(st: RequestState, num_scheduled: int) -> int:
    """Positions of this step whose next token is a prompt token whose logprob `st` asked for
    (they start at the step's first position, st.num_computed_tokens)."""
    if st.sampling_params.prompt_logprobs is None:
        return 0
    start = st.num_computed_tokens
    return max(0, min(start + num_scheduled, st.num_prompt_tokens - 1) - start)


def prepare_prompt_logprobs(scheduled: list[tuple[RequestState, int]], *,
                            num_tokens_bucket: int) -> PromptLogprobsInputs | None:
    """The prompt-logprobs inputs of a step, or None when no request of it needs any (the common case)."""
    next_ids, want_top, t = None, False, 0
    for st, n in scheduled:
        m = num_prompt_logprob_positions(st, n)
        if m:
            if next_ids is None:
                next_ids = np.zeros(num_tokens_bucket, np.int32)
            start = st.num_computed_tokens
            next_ids[t:t + m] = st.token_ids[start + 1:start + 1 + m]
            want_top |= st.sampling_params.prompt_logprobs > 0
        t += n
    return None if next_ids is None else PromptLogprobsInputs(next_token_ids=next_ids, want_top=np.bool_(want_top))


def seed32(seed: int) -> int:
    """A 64-bit seed folded into the sampler's 32 bits. A seed in [-2**32, 2**32) keeps its low 32 bits,
    as before 64-bit seeds; past it the high word, mixed by a multiply with an odd constant, is XOR-ed
    into the low one, so seeds that differ only above bit 31 differ (and 2**32 + k is not k's neighbour)."""
    if -2**32 <= seed < 2**32:
        return seed & 0xFFFFFFFF
    high = (seed >> 32) & 0xFFFFFFFF
    return (seed & 0xFFFFFFFF) ^ (high * 0x9E3779B1 & 0xFFFFFFFF)


def prepare_inputs(
    scheduled: list[tuple[RequestState, int]],
    *,
    num_tokens_bucket: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
    grammars: dict | None = None,
    drafts: dict[str, list[int]] | None = None,
    num_rows: int | None = None,
) -> StepInputs:
    """Padded numpy inputs for one step. `scheduled`: (request state, tokens this step), in order.

    `grammars`: {request id: Grammar} of the constrained requests that sample this step (they fill
    their rows of the allowed-token bitmask). `drafts`: {request id: draft tokens} scheduled after
    the request's last token (speculative decoding); such a request samples at its last token and
    after every draft, one row each, rows in order. `num_rows`: sampling rows (default: one per
    sequence slot).
    """
    T = num_tokens_bucket
    S = num_seqs_for_bucket(T, max_num_seqs)
    assert len(scheduled) <= S, (len(scheduled), S)
    drafts = drafts or {}
    R = num_rows or S
    input_ids = np.zeros(T, np.int32)
    prev_rows = np.full(T, -1, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.zeros(T, np.int32)
    block_tables = np.zeros((S, max_blocks_per_seq), np.int32)
    context_lens = np.zeros(S, np.int32)
    query_start_loc = np.zeros(S + 1, np.int32)
    logits_indices = np.zeros(R, np.int32)
    banned = np.full((R, MAX_BANNED), -1, np.int32)
    temperature = np.zeros(R, np.float32)
    top_k = np.zeros(R, np.int32)
    top_p = np.ones(R, np.float32)
    min_p = np.zeros(R, np.float32)
    presence = np.zeros(R, np.float32)
    frequency = np.zeros(R, np.float32)
    repetition = np.ones(R, np.float32)
    seeds = np.zeros(R, np.uint32)
    sample_index = np.zeros(R, np.int32)
    penalised = [i for i, (st, _) in enumerate(scheduled) if st.sampling_params.uses_penalties]
    if penalised:
        output_ids = np.full((R, max_model_len), -1, np.int32)
        prompt_ids = np.full((R, max_model_len), -1, np.int32)
    else:   # the common case: one shared read-only array of padding, nothing to fill
        output_ids = prompt_ids = _minus_ones(R, max_model_len)
    biased = any(st.sampling_params.logit_bias for st, _ in scheduled)
    if biased:
        bias_ids = np.full((R, MAX_LOGIT_BIAS), -1, np.int32)
        bias_values = np.zeros((R, MAX_LOGIT_BIAS), np.float32)
    else:
        bias_ids, bias_values = _minus_ones(R, MAX_LOGIT_BIAS), _zeros(R, MAX_LOGIT_BIAS)
    want_logprobs = False

    t = r = 0
    first_row, row_spans = [], []
    for i, (st, n) in enumerate(scheduled):
        start = st.num_computed_tokens
        end = start + n
        pos = np.arange(start, end, dtype=np.int32)
        extra = drafts.get(st.req_id, ())
        input_ids[t:t + n] = (st.token_ids + list(extra) if extra else st.token_ids)[start:end]
        if st.token_ids[-1] == PENDING:   # only ever the last token, and this step computes it
            assert end == len(st.token_ids) and not extra, (st.req_id, start, end, len(st.token_ids))
            prev_rows[t + n - 1] = st.pending_row
        positions[t:t + n] = pos
        blocks = np.asarray(st.block_ids, np.int32)
        slot_mapping[t:t + n] = blocks[pos // block_size] * block_size + pos % block_size
        block_tables[i, :len(blocks)] = blocks
        context_lens[i] = end
        query_start_loc[i + 1] = t + n
        # A row at the last real token and one after each draft: the same sampling, the next index.
        k = len(extra)
        rows = slice(r, r + k + 1)
        logits_indices[rows] = np.arange(t + n - 1 - k, t + n, dtype=np.int32)
        first_row.append(r)
        row_spans.append(rows)
        t += n

        p = st.sampling_params
        temperature[rows], top_k[rows], top_p[rows], min_p[rows] = p.temperature, p.top_k, p.top_p, p.min_p
        seeds[rows] = seed32(st.seed)
        sample_index[rows] = np.arange(st.num_output_tokens, st.num_output_tokens + k + 1)
        want_logprobs |= p.logprobs is not None
        # Penalties and min_tokens' bans need the tokens before each row: the scheduler proposes
        # no drafts for such requests, so they have one row.
        if penalised and p.uses_penalties:
            assert st.token_ids[-1] != PENDING, f"request {st.req_id} needs its last token on the host (penalties)"
            presence[r], frequency[r], repetition[r] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            output_ids[r, :st.num_output_tokens] = st.token_ids[st.num_prompt_tokens:]
            prompt_ids[r, :st.num_prompt_tokens] = st.token_ids[:st.num_prompt_tokens]
        if p.logit_bias:    # every row of the request: its last token's and each draft's
            ids, values = zip(*p.logit_bias.items())
            bias_ids[rows, :len(ids)] = ids
            bias_values[rows, :len(ids)] = values
        if st.num_output_tokens < p.min_tokens:
            ban = [] if p.ignore_eos else list(st.eos_token_ids)
            ban = (ban + list(p.stop_token_ids))[:MAX_BANNED]
            banned[r, :len(ban)] = ban
        r += k + 1
    assert r <= R, (r, R)
    query_start_loc[len(scheduled) + 1:] = t
    width = -(-vocab_size // 32)
    allowed = [i for i, (st, _) in enumerate(scheduled) if st.sampling_params.allowed_token_ids]
    worded = [i for i, (st, _) in enumerate(scheduled) if st.sampling_params.bad_words_token_ids]
    if grammars or allowed or worded:
        bitmask = np.full((R, width), -1, np.int32)
        for (st, _), row in zip(scheduled, first_row):
            if grammars and st.req_id in grammars:   # constrained requests have no drafts: one row each
                grammars[st.req_id].fill_bitmask(bitmask, row)
        for i in allowed:   # every row of the request, drafts' too; with a grammar, both apply
            st = scheduled[i][0]
            if st.allowed_mask is None:
                st.allowed_mask = token_mask(st.sampling_params.allowed_token_ids, width)
            bitmask[row_spans[i]] &= st.allowed_mask
        for i in worded:    # a request with a bad word of 2+ tokens has no drafts: it reads its output
            st = scheduled[i][0]
            bitmask[row_spans[i]] &= ~token_mask(bad_word_bans(st), width)
    else:   # the common case: one shared read-only array, never applied
        bitmask = _minus_ones(R, width)

    attn = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables, context_lens=context_lens,
        query_start_loc=query_start_loc, num_seqs=np.int32(len(scheduled)))
    sampling = SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition, seeds=seeds, sample_index=sample_index,
        output_token_ids=output_ids, prompt_token_ids=prompt_ids)
    return StepInputs(input_ids=input_ids, prev_rows=prev_rows, positions=positions, logits_indices=logits_indices,
                      num_rows=np.int32(r), banned_token_ids=banned, want_logprobs=np.bool_(want_logprobs),
                      token_bitmask=bitmask, use_bitmask=np.bool_(bool(grammars or allowed or worded)),
                      bias_token_ids=bias_ids, bias_values=bias_values, use_bias=np.bool_(biased), attn=attn,
                      sampling=sampling)
