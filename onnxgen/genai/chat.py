"""Chat templates (jinja2, from the package's tokenizer config), rendered like transformers does."""

from __future__ import annotations

import datetime
from typing import Any

from onnxgen.errors import OnnxgenError


class ChatTemplateError(OnnxgenError):
    """The package has no chat template, or the template rejected the messages."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    if not template:
        raise ChatTemplateError("the package's tokenizer_config.json has no chat_template; use a plain prompt")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(template)
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except ChatTemplateError:
        raise
    except Exception as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
