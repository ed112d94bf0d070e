"""Chat templates (jinja2, from the package's tokenizer files), rendered like transformers does."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from onnxgen.errors import OnnxgenError


class ChatTemplateError(OnnxgenError):
    """The package has no chat template, or the template rejected the messages."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def pick_template(template: str | Mapping[str, str] | None) -> str:
    """The template to render: a single one, or of named ones the 'default' (as transformers picks
    without tools)."""
    if isinstance(template, Mapping):
        if "default" not in template:
            raise ChatTemplateError(
                f"the package's chat_template has no 'default' among its named templates {sorted(template)}"
            )
        template = template["default"]
    if not template:
        raise ChatTemplateError(
            "the package has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); "
            "use a plain prompt"
        )
    return template


def render_chat(
    template: str | Mapping[str, str] | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> str:
    template = pick_template(template)
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
