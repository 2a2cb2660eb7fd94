"""On-device sampling: logits at each sequence's last token -> next token ids and logprobs.

Called inside the runner's jitted step on the device thread; a pure function of
`(logits [S, V], SamplingMetadata)` with one static knob (`num_logprobs`). The runner
builds `SamplingMetadata` on the host, one row per sequence slot; zero-filled padding rows
are neutral (temperature 0 = greedy, every filter and penalty off) and their outputs are
ignored.

Semantics follow vLLM V1. Logprobs are of the raw model distribution. Processing order:
penalties -> greedy rows take the argmax -> temperature -> min-p -> top-k -> top-p ->
sample.

Cost is what shapes the code (it runs every step, S up to 256, V ~ 50k, on CPU too):
- Optional stages run under `lax.cond` on a device-side "does any row need this?"
  predicate, so a new request using a new option never recompiles and an all-greedy batch
  costs little more than an argmax plus the logsumexp for its logprob.
- min-p, top-k and top-p are one per-row threshold on the tempered logits (a token
  survives iff its logit >= threshold). min-p's threshold is `max + log(min_p)`, free.
  top-k/top-p thresholds are read off the `_TOP_CANDIDATES` best tokens (`fast_top_k`).
  Rows whose answer lies deeper: top-k by an exact bisection over the vocabulary (32
  passes), top-p by rejection (draw before top-p, redraw while outside the top-p set,
  one pass per round, accepted with probability >= p), with the bisection as a bound.
  There is no full sort (XLA:CPU sorts [64, 49152] in ~0.9 s).
  Tokens tied with the threshold are all kept.
- A random row draws one uniform from `fold_in(key(seed), sample_index)` and inverts
  its CDF in two levels (blocks of `_BLOCK` tokens, then tokens in the chosen block);
  no per-token noise. Every reduction is per row, so a row's token depends only on its
  own logits, seed and index, never on the batch around it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

_SAMPLING_EPS = 1e-5      # temperatures below this are greedy, as in vLLM
_BLOCK = 256              # tokens per block in the two-level argmax and CDF inversion
_TOP_CANDIDATES = 128     # best tokens per row from which top-k/top-p thresholds are read
_MAX_REDRAWS = 16         # rejection rounds for deep top-p before the exact (bisection) cut


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling options of one step (S = max_num_seqs; padded rows are ignored)."""

    temperature: jax.Array         # [S] f32: < 1e-5 means greedy
    top_k: jax.Array               # [S] i32: <= 0 or >= V means off
    top_p: jax.Array               # [S] f32: outside (0, 1) means off
    min_p: jax.Array               # [S] f32: 0 means off
    presence_penalty: jax.Array    # [S] f32: 0 means off
    frequency_penalty: jax.Array   # [S] f32: 0 means off
    repetition_penalty: jax.Array  # [S] f32: 1 (or <= 0, e.g. padding) means off
    seeds: jax.Array               # [S] uint32: per-request seed
    sample_index: jax.Array        # [S] i32: tokens this request has generated so far (RNG stream position)
    output_token_ids: jax.Array    # [S, L] i32: generated tokens, padded with -1
    prompt_token_ids: jax.Array    # [S, L] i32: prompt tokens, padded with -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: jax.Array   # [S] i32
    logprobs: jax.Array            # [S] f32: raw logprob of the sampled token
    top_logprob_ids: jax.Array     # [S, K] i32: K = num_logprobs best tokens of the raw distribution
    top_logprobs: jax.Array        # [S, K] f32: their raw logprobs, best first


def sample(logits: jax.Array, md: SamplingMetadata, *, num_logprobs: int = 0) -> SamplerOutput:
    """Samples one token per row of `logits` [S, V]; `num_logprobs` is static."""
    _check_shapes(logits, md, num_logprobs)
    logits = logits.astype(jnp.float32)
    num_seqs = logits.shape[0]
    lse = jax.nn.logsumexp(logits, axis=-1)  # [S]
    is_random = md.temperature >= _SAMPLING_EPS
    token_ids = lax.cond(jnp.any(is_random), _sample_mixed, _sample_greedy, logits, md, is_random)

    token_logits = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0]
    if num_logprobs > 0:
        top_vals, top_ids = fast_top_k(logits, num_logprobs)
    else:
        top_vals = jnp.zeros((num_seqs, 0), jnp.float32)
        top_ids = jnp.zeros((num_seqs, 0), jnp.int32)
    return SamplerOutput(
        sampled_token_ids=token_ids,
        logprobs=token_logits - lse,
        top_logprob_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_vals - lse[:, None],
    )


def _check_shapes(logits, md: SamplingMetadata, num_logprobs: int) -> None:
    """Raises ValueError at trace time when shapes disagree (they are static)."""
    if logits.ndim != 2:
        raise ValueError(f"logits shape {logits.shape} is invalid: expected [S, V]")
    num_seqs, vocab_size = logits.shape
    for name, value in vars(md).items():
        want = 2 if name.endswith("token_ids") else 1
        if value.ndim != want or value.shape[0] != num_seqs:
            raise ValueError(f"SamplingMetadata.{name} shape {value.shape} is invalid: "
                             f"expected [{num_seqs}{', L' if want == 2 else ''}] for logits {logits.shape}")
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs={num_logprobs} is invalid: expected 0 <= num_logprobs <= {vocab_size}")


def _sample_greedy(logits: jax.Array, md: SamplingMetadata, is_random: jax.Array) -> jax.Array:
    """[S] argmax of the penalised logits. The branches never return `logits` itself, which
    would make XLA copy it (12 MB at S=64, V=49152)."""
    return lax.cond(jnp.any(_penalty_rows(md)),
                    lambda: _argmax(_apply_penalties(logits, md))[0], lambda: _argmax(logits)[0])


def _sample_mixed(logits: jax.Array, md: SamplingMetadata, is_random: jax.Array) -> jax.Array:
    """[S] tokens when some rows sample at random: those rows sample, the others argmax."""
    x = lax.cond(jnp.any(_penalty_rows(md)), _apply_penalties, lambda x, _: x, logits, md)
    random_ids, greedy_ids = _sample_random(x, md, is_random)
    return jnp.where(is_random, random_ids, greedy_ids)


# --- penalties ------------------------------------------------------------------------


def _repetition_on(md: SamplingMetadata) -> jax.Array:
    rp = md.repetition_penalty
    return (rp > 0) & (rp != 1)


def _penalty_rows(md: SamplingMetadata) -> jax.Array:
    """[S] bool: rows with any penalty switched on."""
    return _repetition_on(md) | (md.presence_penalty != 0) | (md.frequency_penalty != 0)


def _scatter_ids(token_ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices to scatter [S, L] ids padded with -1 into an [S, V] array."""
    valid = (token_ids >= 0) & (token_ids < vocab_size)
    cols = jnp.where(valid, token_ids, vocab_size)  # out of range: dropped (-1 would wrap)
    return jnp.arange(token_ids.shape[0])[:, None], cols


def _apply_penalties(x: jax.Array, md: SamplingMetadata) -> jax.Array:
    """vLLM's apply_penalties; rows with every penalty off come back bit-identical."""
    num_seqs, vocab_size = x.shape
    out_rows, out_cols = _scatter_ids(md.output_token_ids, vocab_size)
    counts = jnp.zeros((num_seqs, vocab_size), jnp.int32).at[out_rows, out_cols].add(1, mode="drop")
    prompt_rows, prompt_cols = _scatter_ids(md.prompt_token_ids, vocab_size)
    in_prompt = jnp.zeros((num_seqs, vocab_size), bool).at[prompt_rows, prompt_cols].set(True, mode="drop")
    rep = jnp.where(_repetition_on(md), md.repetition_penalty, 1.0)[:, None]
    x = jnp.where(in_prompt | (counts > 0), jnp.where(x > 0, x / rep, x * rep), x)
    x = x - md.frequency_penalty[:, None] * counts
    return x - md.presence_penalty[:, None] * (counts > 0)


# --- random rows ----------------------------------------------------------------------


def _sample_random(x, md: SamplingMetadata, is_random) -> tuple[jax.Array, jax.Array]:
    """([S] draws for the random rows, [S] argmax for the greedy rows), each garbage in
    the other rows. The argmax comes from the max pass the draws need anyway."""
    num_seqs = x.shape[0]
    temperature = jnp.where(is_random, md.temperature, 1.0)  # greedy rows: x / 1 = x
    xt = x / temperature[:, None]
    greedy_ids, row_max = _argmax(xt)
    d = xt - row_max[:, None]  # [S, V] <= 0; the best token is at 0; exp(d): unnormalised probs

    # min-p drops p_i < min_p * p_max, i.e. d_i < log(min_p); log(0) = -inf drops nothing.
    threshold = jnp.log(jnp.clip(md.min_p, 0.0, 1.0))
    top_k_on = is_random & (md.top_k > 0) & (md.top_k < x.shape[-1])
    top_p_on = is_random & (md.top_p > 0) & (md.top_p < 1)
    no_cut = lambda d, t, *_: (t, jnp.zeros(num_seqs, bool), jnp.zeros(num_seqs, jnp.float32))
    threshold, deep_p, p_mass = lax.cond(jnp.any(top_k_on | top_p_on), _top_k_top_p_threshold,
                                         no_cut, d, threshold, md, top_k_on, top_p_on)

    w = jnp.where(d >= threshold[:, None], jnp.exp(d), 0.0)  # [S, V] weights of the survivors
    cdf = _BlockCdf.build(w)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(md.seeds, md.sample_index)
    tokens = cdf.draw(jax.vmap(jax.random.uniform)(keys))
    tokens = lax.cond(jnp.any(deep_p), _reject_outside_top_p, lambda *a: a[0],
                      tokens, d, w, cdf, keys, deep_p, p_mass)
    return tokens, greedy_ids


def _top_k_top_p_threshold(d, threshold, md, top_k_on, top_p_on):
    """Raises each row's threshold on `d` [S, V] to apply top-k, then top-p on what is left.
    Returns (threshold [S], deep_p [S] rows whose top-p cut lies beyond the candidates,
    p_mass [S] the mass top-p keeps: p * mass left after min-p and top-k)."""
    num_seqs, vocab_size = d.shape
    num_cand = min(_TOP_CANDIDATES, vocab_size)
    cand = fast_top_k(d, num_cand)[0]  # [S, C], best first

    # top-k: the k-th best value, from the candidates when k <= C, else by bisection.
    k = md.top_k
    kth = jnp.take_along_axis(cand, jnp.clip(k - 1, 0, num_cand - 1)[:, None], axis=-1)[:, 0]
    tau_k = jnp.where(top_k_on, kth, -jnp.inf)
    deep_k = top_k_on & (k > num_cand)
    tau_k = lax.cond(jnp.any(deep_k),
                     lambda: jnp.where(deep_k, _kth_largest(d, k), tau_k), lambda: tau_k)
    threshold = jnp.maximum(threshold, tau_k)

    # top-p over the renormalised survivors: keep the best tokens while the mass *before*
    # a token is < p * mass (vLLM: the smallest set with mass >= p; the best token stays).
    p_mass = md.top_p * jnp.sum(jnp.where(d >= threshold[:, None], jnp.exp(d), 0.0), axis=-1)
    wc = jnp.where(cand >= threshold[:, None], jnp.exp(cand), 0.0)
    incl = jnp.cumsum(wc, axis=-1)
    excl = jnp.concatenate([jnp.zeros((num_seqs, 1), jnp.float32), incl[:, :-1]], axis=-1)
    n_keep = jnp.maximum(jnp.sum(excl < p_mass[:, None], axis=-1), 1)
    p_fits = (n_keep < num_cand) | (incl[:, -1] >= p_mass)
    tau_p = jnp.take_along_axis(cand, (n_keep - 1)[:, None], axis=-1)[:, 0]
    tau_p = jnp.where(top_p_on & p_fits, tau_p, -jnp.inf)
    return jnp.maximum(threshold, tau_p), top_p_on & ~p_fits, p_mass


def _reject_outside_top_p(tokens, d, w, cdf, keys, deep_p, p_mass):
    """Rows whose top-p set is larger than the candidates: draw from the distribution
    before top-p and redraw while the token falls outside the top-p set (rejection
    sampling: exact, and each draw is accepted with probability >= p). Rows still
    outside after `_MAX_REDRAWS` get the exact cut by bisection."""
    def inside(tokens):  # vLLM's rule: the mass strictly above the token is < p * mass
        d_tok = jnp.take_along_axis(d, tokens[:, None], axis=-1)
        return jnp.sum(jnp.where(d > d_tok, w, 0.0), axis=-1) < p_mass

    def redraw(state):
        tokens, done, attempt = state
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, attempt)))(keys)
        tokens = jnp.where(done, tokens, cdf.draw(u))
        return tokens, done | inside(tokens), attempt + 1

    done = ~deep_p | inside(tokens)
    tokens, done, attempt = lax.while_loop(
        lambda s: jnp.any(~s[1]) & (s[2] <= _MAX_REDRAWS), redraw, (tokens, done, 1))

    def exact_cut():
        tau = _top_p_cut(d, w, p_mass)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, attempt)))(keys)
        return jnp.where(done, tokens, _BlockCdf.build(jnp.where(d >= tau[:, None], w, 0.0)).draw(u))
    return lax.cond(jnp.any(~done), exact_cut, lambda: tokens)


# --- exact thresholds by bisection (fallback when the candidates are not enough) --------


def _sort_key(x: jax.Array) -> jax.Array:
    """f32 -> i32 with the same order (no NaNs)."""
    b = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b >= 0, b, b ^ 0x7FFFFFFF)


def _from_sort_key(key: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ 0x7FFFFFFF), jnp.float32)


def _largest_value_where(d: jax.Array, pred) -> jax.Array:
    """[S] per row of `d` [S, V] (row max 0), the largest value v of the row with pred(v),
    for pred [S] -> [S] monotone (true at the row min, false above 0). Bisection over the
    floats' ordered bit patterns: exact, at most 32 passes over the rows."""
    def body(state):
        lo, hi = state
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = pred(_from_sort_key(mid))
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    lo = _sort_key(jnp.min(d, axis=-1))
    hi = jnp.ones_like(lo)  # one past the key of 0.0, the row max
    lo, _ = lax.while_loop(lambda s: jnp.any(s[0] + 1 < s[1]), body, (lo, hi))
    return _from_sort_key(lo)


def _kth_largest(d: jax.Array, k: jax.Array) -> jax.Array:
    """[S] the k-th largest value of each row of `d` (row max 0)."""
    def at_least_k(v):  # counted in f32 (exact below 2**24), faster than i32 on XLA:CPU
        return jnp.sum(jnp.where(d >= v[:, None], 1.0, 0.0), axis=-1) >= k
    return _largest_value_where(d, at_least_k)


def _top_p_cut(d: jax.Array, w: jax.Array, p_mass: jax.Array) -> jax.Array:
    """[S] the largest value v with mass(d >= v) >= p_mass: the top-p cut (w: live weights)."""
    def enough_mass(v):
        return jnp.sum(jnp.where(d >= v[:, None], w, 0.0), axis=-1) >= p_mass
    return _largest_value_where(d, enough_mass)


# --- two-level reductions -------------------------------------------------------------


def _blocks(x: jax.Array, fill: float, block: int = _BLOCK) -> jax.Array:
    """[S, V] -> [S, V / B, B], padding the vocabulary with `fill` when B does not divide V."""
    num_seqs, vocab_size = x.shape
    block = min(block, vocab_size)
    pad = -vocab_size % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
    return x.reshape(num_seqs, -1, block)


def _argmax(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([S] i32 first index of each row's max, like jnp.argmax; [S] the max). XLA:CPU's
    variadic argmax reduce is several times slower than a max: this is one max pass over
    blocks plus an argmax inside the best block."""
    xb = _blocks(x, -jnp.inf)
    block_max = jnp.max(xb, axis=-1)                                   # [S, nb]
    block = jnp.argmax(block_max, axis=-1)                             # [S]
    row = jnp.take_along_axis(xb, block[:, None, None], axis=1)[:, 0]  # [S, B]
    ids = block * xb.shape[-1] + jnp.argmax(row, axis=-1)
    return ids.astype(jnp.int32), jnp.max(block_max, axis=-1)


def fast_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, k) for [S, V], ties included (lower index first), in about one pass:
    the k best elements lie in the k blocks with the best maxima (each better-ranked
    block holds a distinct better element), so top_k runs on [S, V / B] and [S, k * B]
    only. XLA:CPU's top_k over the whole row costs several passes."""
    num_seqs, vocab_size = x.shape
    block = 1 << max(0, round(math.log2(max(vocab_size / k, 1)) / 2))  # ~sqrt(V / k)
    if block < 4 or k * block >= vocab_size:
        return lax.top_k(x, k)
    xb = _blocks(x, -jnp.inf, block)                                     # [S, nb, B]
    best = jnp.sort(lax.top_k(jnp.max(xb, axis=-1), k)[1], axis=-1)      # [S, k] by index
    cand = jnp.take_along_axis(xb, best[:, :, None], axis=1).reshape(num_seqs, k * block)
    values, pos = lax.top_k(cand, k)
    ids = jnp.take_along_axis(best, pos // block, axis=-1) * block + pos % block
    return values, ids.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BlockCdf:
    """Inverse-CDF sampling from weights [S, V] in two levels: pick a block of B tokens
    from the block masses, then a token inside it. One pass over the weights to build;
    each draw touches [S, V / B] + [S, B]."""

    blocks: jax.Array  # [S, nb, B] weights, zero-padded
    cum: jax.Array     # [S, nb] cumulative block masses

    @staticmethod
    def build(w: jax.Array) -> "_BlockCdf":
        wb = _blocks(w, 0.0)
        return _BlockCdf(blocks=wb, cum=jnp.cumsum(jnp.sum(wb, axis=-1), axis=-1))

    def draw(self, u: jax.Array) -> jax.Array:
        """[S] i32 index i with probability w[i] / sum(w), from u [S] in [0, 1). Never an
        index of weight 0 (rounding can only push the target past the end, handled below)."""
        num_blocks, block_size = self.blocks.shape[1:]
        target = u * self.cum[:, -1]
        block = jnp.sum(self.cum <= target[:, None], axis=-1)
        nonempty = self.cum > jnp.concatenate([jnp.zeros_like(self.cum[:, :1]), self.cum[:, :-1]], -1)
        block = jnp.minimum(block, jnp.max(jnp.where(nonempty, jnp.arange(num_blocks), 0), axis=-1))
        before = jnp.take_along_axis(self.cum, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0]
        before = jnp.where(block > 0, before, 0.0)

        row = jnp.take_along_axis(self.blocks, block[:, None, None], axis=1)[:, 0]  # [S, B]
        j = jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1)
        last = jnp.max(jnp.where(row > 0, jnp.arange(block_size), 0), axis=-1)
        return (block * block_size + jnp.minimum(j, last)).astype(jnp.int32)
