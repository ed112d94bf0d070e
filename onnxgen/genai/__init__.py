"""Generation on top of the runtime: KV state, decode loop, sampling, tokenizer, chat templates."""

from onnxgen.genai.generator import GenerationStats, Generator
from onnxgen.genai.sampling import SamplingParams

__all__ = ["GenerationStats", "Generator", "SamplingParams"]
