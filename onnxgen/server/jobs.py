"""A validated request to the scheduler's jobs: prompts to checked token ids, request fields to
checked ``SamplingParams``, one job per choice.

Runs off the event loop (``asyncio.to_thread``): tokenizing and the chat template are CPU work.
Everything that can refuse a request before it runs is checked here, so a request that reaches
the engine only fails for an engine reason:

- the prompt fits the context (``PromptTooLongError``'s message says its token count and the
  context) and so does the prompt plus ``max_tokens``;
- the sampling values are in range (``SamplingParams.validate``), mapped to the request's field.

Choices: choice ``i`` of a prompt runs with seed ``seed + i`` (mod 2**64) when the request has a
seed, so choice 0 of an n > 1 request is what the same request with n = 1 gives; without a seed
every choice draws a fresh one. Completions with several prompts number their choices prompt by
prompt: prompt p's choice i is index ``p * n + i``, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.genai.chat import ChatTemplateError
from onnxgen.genai.generator import PromptTooLongError
from onnxgen.genai.sampling import SamplingError, SamplingParams
from onnxgen.genai.scheduler import Job
from onnxgen.server.errors import ApiError, invalid
from onnxgen.server.protocol import SEED_LIMIT, GenerationRequest

if TYPE_CHECKING:
    from onnxgen.genai.generator import Generator


@dataclass
class Plan:
    """The jobs of a request, with per job its prompt's token count and the text echoed in front
    of its choice ("" without echo)."""

    jobs: list[Job]
    prompt_tokens: list[int]
    prefixes: list[str]
    n: int = 1  # choices per prompt

    @property
    def total_prompt_tokens(self) -> int:
        """Usage counts each prompt once (the choices of one prompt share it), as OpenAI does."""
        return sum(self.prompt_tokens[:: self.n])


def _prompt_error(exc: OnnxgenError, param: str) -> ApiError:
    if isinstance(exc, PromptTooLongError):
        return invalid(str(exc), param, "context_length_exceeded")
    return invalid(str(exc), param)


def encode_prompt(generator: Generator, request: GenerationRequest) -> list[tuple[list[int], str, str]]:
    """(checked prompt ids, the field they came from, the echo text) per prompt."""
    if request.kind == "chat":
        try:
            return [(generator.encode_messages(request.messages), "messages", "")]
        except (InvalidInputError, PromptTooLongError, ChatTemplateError) as exc:
            raise _prompt_error(exc, "messages") from None
    prompts = []
    for index, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{index}]"
        try:
            ids = generator.encode(prompt)
        except (InvalidInputError, PromptTooLongError) as exc:
            raise _prompt_error(exc, param) from None
        echo = ""
        if request.echo:
            echo = prompt if isinstance(prompt, str) else generator.tokenizer.decode(ids, skip_special_tokens=False)
        prompts.append((ids, param, echo))
    return prompts


def _sampling_param(name: str, request: GenerationRequest) -> str:
    """The request field a SamplingParams field came from."""
    if name == "max_new_tokens":
        return request.max_tokens_param
    if name == "logprobs" and request.kind == "chat":
        return "top_logprobs"
    return name


def sampling_params(request: GenerationRequest, choice: int) -> SamplingParams:
    """The checked parameters of choice ``choice`` (of its prompt)."""
    kwargs: dict[str, Any] = dict(request.sampling)
    kwargs["stop"] = list(request.stop)
    kwargs["max_new_tokens"] = request.max_tokens
    if request.seed is not None:
        kwargs["seed"] = (request.seed + choice) % SEED_LIMIT
    if request.logprobs is not None:
        kwargs["logprobs"] = request.logprobs
    try:
        params = SamplingParams(**kwargs)
    except TypeError as exc:  # a field this build's SamplingParams lacks
        name = next((k for k in kwargs if f"'{k}'" in str(exc)), "?")
        param = _sampling_param(name, request)
        raise invalid(f"{param} is not supported by this build of onnxgen", param, "unsupported_parameter") from None
    try:
        return params.validate()
    except SamplingError as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        name = name if name in kwargs else "stop" if message.startswith("stop") else name
        param = _sampling_param(name, request)
        if param != name:
            message = message.replace(name, param, 1)
        raise invalid(message, param) from None


def build_plan(generator: Generator, request: GenerationRequest, sequence_limit: int | None = None) -> Plan:
    """The request's jobs, checked against the tokens one sequence may hold: ``sequence_limit`` (a
    batching server's --max-model-len), else the model's context."""
    model_context = generator.config.context_length
    context = min(sequence_limit or model_context, model_context)
    where = f"this model's context of {context}"
    if context < model_context:
        where = f"this server's --max-model-len of {context} (the model's context is {model_context})"
    prompts = encode_prompt(generator, request)
    min_tokens = request.sampling.get("min_tokens", 0)
    if request.max_tokens is not None and min_tokens > request.max_tokens:
        raise invalid(
            f"min_tokens ({min_tokens}) must not exceed {request.max_tokens_param} ({request.max_tokens})", "min_tokens"
        )
    jobs, counts, prefixes = [], [], []
    for ids, param, echo in prompts:
        if len(ids) >= context:
            raise invalid(
                f"the prompt ({param}) is {len(ids)} tokens; {where} leaves no room for a new token",
                param,
                "context_length_exceeded",
            )
        if request.max_tokens is not None and len(ids) + request.max_tokens > context:
            raise invalid(
                f"the prompt ({param}) is {len(ids)} tokens and {request.max_tokens_param} asks for "
                f"{request.max_tokens} more: {len(ids) + request.max_tokens} tokens, beyond {where}",
                request.max_tokens_param,
                "context_length_exceeded",
            )
        for choice in range(request.n):
            jobs.append(Job(ids, sampling_params(request, choice)))
            counts.append(len(ids))
            prefixes.append(echo)
    return Plan(jobs, counts, prefixes, n=request.n)
