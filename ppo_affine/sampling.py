"""Next-token sampling whose draws depend only on each request's seed and the token's place in its reply.

Local generation serves requests as they come (continuous batching), so which rows share a decode
step depends on timing. A single random generator drawn over the batch, as `generate` and
transformers' continuous-batching manager do, would then give a request different tokens run to
run. Here every draw is a Gumbel-max draw whose noise is a hash of (request seed, token index,
vocabulary id): the same request samples the same tokens whatever it was batched with, so a seeded
run and its resumed copy generate alike, as far as the logits are the same (exactly in float32 on CPU;
in bf16 on a GPU the batch moves them ~1e-2, and tokens whose scores nearly tie can differ). Argmax of (scores / temperature + Gumbel noise) is an
exact sample of softmax(scores / temperature); top-k and top-p keep the highest-scoring tokens.
"""
from __future__ import annotations

import torch


def _as_int64(constant: int) -> int:
    """A 64-bit constant as the signed value an int64 tensor holds (its arithmetic wraps modulo 2**64)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)  # splitmix64's increment
_MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_2 = _as_int64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijective hash of each int64 value with good avalanche."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def row_keys(seeds: list[int], counters: list[int]) -> list[int]:
    """Each row's key, hashed on the host (Python ints): splitmix64 of seed * golden ratio + counter, as int64."""
    keys = []
    for seed, counter in zip(seeds, counters):
        x = (seed * 0x9E3779B97F4A7C15 + counter) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        keys.append(_as_int64(x ^ (x >> 31)))
    return keys


_VOCAB_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """(id + 1) * golden ratio for every vocabulary id, made once per vocabulary size and device."""
    cache_key = (vocab, str(device))
    if cache_key not in _VOCAB_KEYS:
        _VOCAB_KEYS[cache_key] = (torch.arange(vocab, device=device, dtype=torch.long) + 1) * _GOLDEN
    return _VOCAB_KEYS[cache_key]


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float64 in (0, 1): row b's value for token v is a hash of (keys[b], v)."""
    bits = mix64(keys[:, None] + _vocab_keys(vocab, keys.device))
    return (_shift_right(bits, 11).double() + 0.5) * (1.0 / (1 << 53))


def filter_scores(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Scores with everything outside the top-k and the top-p nucleus set to -inf (the best token always stays)."""
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p  # a token joins while the mass of the better ones is short of top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return scores


def draw_keys(seeds: list[int], counters: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[B] int64: the rows' draw keys, copied to `device`, with the vocabulary's keys made there once. The one
    host-to-device copy a draw needs, for the caller to make before it launches a step's kernels: a copy from
    the host waits for the kernels queued before it (PyTorch synchronises the stream)."""
    _vocab_keys(vocab, device)
    return torch.tensor(row_keys(seeds, counters), dtype=torch.long, device=device)


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] token ids and [B] float64 log-probs of them under the distribution they were drawn from: greedy at
    temperature 0 (log-probs of the untempered logits, as the trainer scores them there), else a sample of
    softmax(filtered logits / temperature). Row b's draw is keyed by keys[b] (`draw_keys`); every operation is
    batched and on the logits' device (a decode step's few dozen kernels, no copy from the host)."""
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        return tokens, _logprobs_of(logits.double(), tokens)
    scores = logits.double() if temperature == 1 else logits.double() / temperature
    scores = filter_scores(scores, top_k, top_p)
    # Gumbel-max: argmax(scores + Gumbel noise), the noise written -log(-log u)
    tokens = (scores - torch.log(-torch.log(uniform_noise(keys, logits.shape[-1])))).argmax(dim=-1)
    return tokens, _logprobs_of(scores, tokens)


def _logprobs_of(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B] log softmax(scores)[b, tokens[b]]; filtered tokens' -inf scores drop out of the normaliser."""
    return scores.gather(-1, tokens[:, None]).squeeze(-1) - scores.logsumexp(dim=-1)
