"""Sampling: transformers' logits processors are the oracle for each stage; draws are checked statistically."""

from __future__ import annotations

import pytest
import torch

from onnxgen.genai.sampling import LogitsSampler, SamplingError, SamplingParams

VOCAB = 50


def fixed_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(VOCAB, generator=g) * 2.0


def hf_process(logits: torch.Tensor, **kw) -> torch.Tensor:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.clone().reshape(1, -1)
    ids = kw.get("ids", torch.zeros((1, 0), dtype=torch.long))
    if kw.get("repetition_penalty", 1.0) != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"])(ids, scores)
    if "temperature" in kw:
        scores = TemperatureLogitsWarper(kw["temperature"])(ids, scores)
    if kw.get("top_k"):
        scores = TopKLogitsWarper(kw["top_k"])(ids, scores)
    if kw.get("top_p", 1.0) < 1.0:
        scores = TopPLogitsWarper(kw["top_p"])(ids, scores)
    if kw.get("min_p"):
        scores = MinPLogitsWarper(kw["min_p"])(ids, scores)
    return scores.reshape(-1)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.6},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.1},
    ],
)
def test_processed_logits_match_transformers(kw):
    logits = fixed_logits()
    ours = LogitsSampler(SamplingParams(seed=0, **kw), VOCAB, torch.device("cpu")).process(logits)
    theirs = hf_process(logits, **kw)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "kept token sets differ"
    kept = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[kept], theirs[kept])


def test_repetition_penalty_matches_transformers():
    logits = fixed_logits()
    seen = torch.tensor([[3, 7, 7, 11, 40]])
    sampler = LogitsSampler(SamplingParams(repetition_penalty=1.3), VOCAB, torch.device("cpu"))
    sampler.observe(seen)
    torch.testing.assert_close(sampler.process(logits), hf_process(logits, repetition_penalty=1.3, ids=seen))


def test_frequency_and_presence_penalties_follow_openai_definition():
    logits = fixed_logits()
    sampler = LogitsSampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), VOCAB, torch.device("cpu"))
    sampler.observe(torch.tensor([4, 4, 4, 9]))
    expected = logits.clone()
    expected[4] -= 3 * 0.5 + 0.25
    expected[9] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(sampler.process(logits), expected)


def test_greedy_is_argmax():
    logits = fixed_logits()
    assert int(LogitsSampler(SamplingParams(), VOCAB, torch.device("cpu")).sample(logits)) == int(logits.argmax())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.7, seed=3)]
)
def test_sample_into_a_buffer(dtype: torch.dtype, params: SamplingParams) -> None:
    """sample(out=) writes the token into the caller's 0-d tensor and returns it; plain greedy takes
    the argmax of the logits as they are (no fp32 copy), which picks the token the fp32 logits do."""
    logits = (torch.randn(1, 1, 300, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    logits[0, 0, 7] = logits[0, 0, 250] = logits.max()  # a tie: the first index wins either way
    sampler = LogitsSampler(params, 260, torch.device("cpu"))  # the padded rows past 260 never win
    sampler.observe(torch.tensor([7]))
    want = LogitsSampler(params, 260, torch.device("cpu"))
    want.observe(torch.tensor([7]))
    buffer = torch.full((1, 1), -1, dtype=torch.int64)
    got = sampler.sample(logits, out=buffer.view(()))
    assert got.data_ptr() == buffer.data_ptr() and int(buffer) == int(want.sample(logits))
    if params.greedy and params.repetition_penalty == 1.0:
        assert int(buffer) == int(torch.argmax(logits.reshape(-1)[:260].float())) == 7


def test_seeded_sampling_is_reproducible():
    logits = fixed_logits()

    def draws(seed: int) -> list[int]:
        s = LogitsSampler(SamplingParams(temperature=1.0, seed=seed), VOCAB, torch.device("cpu"))
        return [int(s.sample(logits)) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize(
    "kw", [{"temperature": 0.8}, {"temperature": 1.5, "top_k": 6}, {"temperature": 1.0, "top_p": 0.7}]
)
def test_draw_frequencies_follow_the_distribution(kw):
    """Chi-square goodness of fit of 20,000 draws against softmax of transformers' processed logits."""
    logits = fixed_logits()
    probs = torch.softmax(hf_process(logits, **kw), dim=-1)
    sampler = LogitsSampler(SamplingParams(seed=3, **kw), VOCAB, torch.device("cpu"))
    n = 20_000
    counts = torch.zeros(VOCAB)
    for _ in range(n):
        counts[int(sampler.sample(logits))] += 1
    assert counts[probs == 0].sum() == 0, "drew a token the filters exclude"
    expected = probs * n
    mask = expected > 5
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    dof = int(mask.sum()) - 1
    # 99.9th percentile of chi-square is below dof + 4.5*sqrt(2*dof) + 10 for these dof
    assert chi2 < dof + 4.5 * (2 * dof) ** 0.5 + 10, f"chi2 {chi2:.1f} with {dof} dof"


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\)"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"stop": [""]}, "stop strings must not be empty"),
    ],
)
def test_invalid_values_are_refused(kw, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kw).validate()
