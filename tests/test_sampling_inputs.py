"""Bad sampling values and token ids get SamplingError/InvalidInputError naming the value; extreme but
valid values sample without NaN; a model whose logits are NaN fails loudly instead of printing nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from onnxgen.errors import InvalidInputError
from onnxgen.genai.sampling import LogitsSampler, NonFiniteLogitsError, SamplingError, SamplingParams

VOCAB = 50


@pytest.fixture(scope="module")
def int4_package():
    """The cached int4 CPU package of the default model (read only; the CI fixture pulls it)."""
    from onnxgen.errors import RegistryUnreachableError
    from onnxgen.models.pull import ensure_package

    try:
        return ensure_package("smollm2-135m-instruct", device="cpu", precision="int4", attention="gqa")
    except RegistryUnreachableError as exc:
        pytest.skip(f"cannot pull the default model: {exc}")


def fixed_logits() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(99)) * 3.0


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"temperature": "0.5"}, ["temperature", "'0.5'", "number"]),
        ({"temperature": float("nan")}, ["temperature", "nan", "finite"]),
        ({"temperature": float("inf")}, ["temperature", "inf", "finite"]),
        ({"top_p": float("nan")}, ["top_p", "nan"]),
        ({"min_p": float("nan")}, ["min_p", "nan"]),
        ({"repetition_penalty": float("nan")}, ["repetition_penalty", "nan"]),
        ({"frequency_penalty": float("nan")}, ["frequency_penalty", "nan"]),
        ({"presence_penalty": float("-inf")}, ["presence_penalty", "-inf"]),
        ({"temperature": True}, ["temperature", "True", "number"]),
        ({"top_k": 1.5}, ["top_k", "1.5", "int"]),
        ({"top_k": "3"}, ["top_k", "'3'", "int"]),
        ({"seed": "x"}, ["seed", "'x'", "int"]),
        ({"seed": 2**64}, ["seed", str(2**64), "2**64"]),
        ({"seed": -1}, ["seed", "-1", ">= 0"]),
        ({"max_new_tokens": True}, ["max_new_tokens", "True", "int"]),
        ({"max_new_tokens": 2.0}, ["max_new_tokens", "2.0", "int"]),
        ({"stop": 5}, ["stop", "5", "str"]),
        ({"stop": ["ok", 3]}, ["stop", "3", "str"]),
        ({"ignore_eos": "yes"}, ["ignore_eos", "'yes'", "bool"]),
    ],
)
def test_bad_types_and_non_finite_values_are_sampling_errors(kw, words):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kw).validate()
    for word in words:
        assert word in str(info.value), f"{word!r} missing from: {info.value}"


def test_numpy_scalars_and_seed_bounds_are_accepted():
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(2**64 - 1), max_new_tokens=np.int32(4)
    ).validate()
    LogitsSampler(params, VOCAB, torch.device("cpu")).sample(fixed_logits())
    SamplingParams(temperature=1.0, seed=0).validate()


def test_stop_string_is_one_string_not_its_letters():
    assert SamplingParams(stop="Paris").validate().stop == ["Paris"]
    assert SamplingParams(stop=("a b", "c")).validate().stop == ["a b", "c"]


@pytest.mark.parametrize("temperature", [1e-39, 1e-46, 5e-324, 1e-4])
@pytest.mark.parametrize("top", [{}, {"top_p": 0.9}, {"min_p": 0.1}, {"top_k": 5}])
def test_tiny_temperature_samples_the_argmax(temperature, top):
    """(x - max) / T: the largest logit maps to 0 and every other to a large negative or -inf, so a
    temperature that overflows float32 (or is a float32 zero) draws the argmax, never NaN."""
    logits = fixed_logits()
    sampler = LogitsSampler(SamplingParams(temperature=temperature, seed=1, **top), VOCAB, torch.device("cpu"))
    processed = sampler.process(logits)
    assert not torch.isnan(processed).any()
    assert {int(sampler.sample(logits)) for _ in range(20)} == {int(logits.argmax())}


def test_tiny_temperature_draws_among_tied_maxima():
    """Exactly tied largest logits (quantized models have them): the limit of softmax as T -> 0 is
    uniform over the tied tokens, so a tiny temperature draws each of them, never another one."""
    logits = fixed_logits()
    tied = [4, 19, 33]
    logits[tied] = logits.max() + 1.0
    sampler = LogitsSampler(SamplingParams(temperature=1e-39, seed=5), VOCAB, torch.device("cpu"))
    draws = [int(sampler.sample(logits)) for _ in range(90)]
    assert set(draws) == set(tied)
    assert all(draws.count(t) > 15 for t in tied), draws


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("penalty", [1e-45, 1e-30, 1e300])
def test_extreme_repetition_penalty_keeps_the_order(temperature, penalty):
    """A tiny penalty multiplies the seen positive logits by ~1/penalty: the best of them wins (not
    the first one to overflow); a huge one divides them to ~0 and pushes the seen negative ones to
    -inf. A seen logit of exactly 0 stays 0 (0 * inf would be NaN)."""
    logits = torch.tensor([0.5, 2.0, -1.0, 0.0, 3.0, 1.5])
    seen = torch.tensor([0, 1, 2, 3, 5])  # 4 (the largest logit) is not seen
    sampler = LogitsSampler(
        SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=2), 6, torch.device("cpu")
    )
    sampler.observe(seen)
    processed = sampler.process(logits)
    assert not torch.isnan(processed).any()
    draws = {int(sampler.sample(logits)) for _ in range(20)}
    if penalty < 1:
        assert draws == {1}, processed  # the largest seen positive logit, 2.0
    else:
        assert draws <= {4, 3, 0, 1, 5} and 4 in draws  # 3.0 unseen stays on top; -1.0 seen is excluded


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(repetition_penalty=1.2), SamplingParams(temperature=0.8, seed=0)],
    ids=["greedy", "greedy-penalized", "sampled"],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_reported(params, bad):
    logits = fixed_logits()
    logits[7] = bad
    sampler = LogitsSampler(params, VOCAB, torch.device("cpu"))
    sampler.observe(torch.tensor([7, 8]))
    with pytest.raises(NonFiniteLogitsError, match="non-finite"):
        sampler.check(sampler.sample(logits))


# -- the Generator's entry checks and the run-time check, on the real model ---------------------


@pytest.fixture(scope="module")
def generators(int4_package):
    from onnxgen.genai.generator import Generator

    return {
        "sequential": Generator(int4_package, kv="dynamic"),
        "pipelined": Generator(int4_package, kv="static", pipeline="on"),
    }


@pytest.mark.parametrize(
    "ids, words",
    [
        ([1, 2.5], ["2.5", "float", "int"]),
        ([True, 5], ["True", "bool"]),
        ([5, 10**6], [str(10**6), "49152"]),
        ([-100000], ["-100000", "49152"]),
        ([1, -1], ["-1", "[0, 49152)"]),
        ([1, "2"], ["'2'", "str"]),
    ],
)
def test_bad_token_ids_are_refused(generators, ids, words):
    generator = generators["sequential"]
    for call in (
        lambda: generator.encode(ids),
        lambda: next(generator.generate_ids(ids, SamplingParams(max_new_tokens=1))),
        lambda: next(generator.stream(ids, SamplingParams(max_new_tokens=1))),
    ):
        with pytest.raises(InvalidInputError) as info:
            call()
        for word in words:
            assert word in str(info.value), f"{word!r} missing from: {info.value}"


@pytest.mark.parametrize("params", [{"temperature": 0.5}, 0.5, "greedy"])
def test_params_that_are_not_sampling_params_are_refused(generators, params):
    generator = generators["sequential"]
    for call in (
        lambda: generator.generate("Hi", params),
        lambda: next(generator.generate_ids([1, 2], params)),
    ):
        with pytest.raises(
            SamplingError, match=rf"params must be a SamplingParams or None, got {type(params).__name__}"
        ):
            call()


@pytest.mark.parametrize("device", ["gpu", "tpu:0", 3])
def test_generator_device_names_are_checked_first(int4_package, device):
    from onnxgen.genai.generator import Generator

    with pytest.raises(InvalidInputError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        Generator(int4_package, device=device)


def test_numpy_token_ids_are_accepted(generators):
    generator = generators["sequential"]
    ids = generator.encode("Hello")
    assert generator.encode([np.int64(i) for i in ids]) == ids
    assert all(type(i) is int for i in generator.encode([np.int32(i) for i in ids]))


def test_lone_surrogate_prompt_is_an_input_error(generators):
    with pytest.raises(InvalidInputError, match="UTF-8"):
        generators["sequential"].encode("caf\udce9")


def _poison(generator, at_step: int, monkeypatch) -> None:
    """From step ``at_step`` on (0: the prefill), the decoder's logits are NaN."""
    run, steps = generator.session.run_torch, [0]

    def poisoned(feeds):
        outputs = dict(run(feeds))
        if steps[0] >= at_step:
            name = generator.config.io.logits
            outputs[name] = torch.full_like(outputs[name], math.nan)
        steps[0] += 1
        return outputs

    monkeypatch.setattr(generator.session, "run_torch", poisoned)


@pytest.mark.parametrize("kind", ["sequential", "pipelined"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=0.7, seed=1)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("at_step", [0, 3])
def test_nan_logits_stop_the_generation_with_an_error(generators, kind, params, at_step, monkeypatch):
    generator = generators[kind]
    _poison(generator, at_step, monkeypatch)
    got: list[int] = []
    with pytest.raises(NonFiniteLogitsError, match="non-finite") as info:
        for token in generator.generate_ids(generator.encode("The capital of France is"), params):
            got.append(token)
    assert len(got) == at_step, "tokens before the NaN step are handed out, none after"
    assert f"new token {at_step + 1}" in str(info.value)
