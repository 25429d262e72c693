"""Chat templates: `chat_template: auto`, a built-in name, or an inline Jinja template.

Why built-ins live here as plain strings: a merge of models fine-tuned on different prompt formats
often needs one named format in the output, and users write `chat_template: chatml` in mergekit
configs. The templates below are written from each format's published layout (ChatML, Llama 3,
Mistral [INST], Alpaca, EXAONE) and follow transformers' conventions: `messages` with `role` and
`content`, `bos_token`/`eos_token` variables, and `add_generation_prompt`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from ..errors import ConfigError

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

_MISTRAL = (
    "{% set ns = namespace(system='') %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.system = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

_ALPACA = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
)

_EXAONE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '[|system|][|endofturn|]\\n' }}{% endif %}"
    "{{ '[|' + message['role'] + '|]' + message['content'] }}"
    "{% if message['role'] == 'user' %}{{ '\\n' }}{% else %}{{ '[|endofturn|]\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '[|assistant|]' }}{% endif %}"
)

BUILTIN_TEMPLATES: dict[str, str] = {
    "alpaca": _ALPACA,
    "chatml": _CHATML,
    "exaone": _EXAONE,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
}


def is_inline_template(value: str) -> bool:
    """An inline template is anything with a Jinja delimiter; a bare word is a built-in name."""
    return "{" in value


def resolve_chat_template(value: str, input_templates: Iterable[str | None], source: str = "config") -> str | None:
    """The template text `chat_template: value` selects, or None when `auto` finds no template.

    `auto` takes the most common template among the inputs (by stripped text, first seen on ties),
    as mergekit does; a name must be one of BUILTIN_TEMPLATES; an inline template must parse.
    """
    if value == "auto":
        found = [t.strip() for t in input_templates if isinstance(t, str) and t.strip()]
        return Counter(found).most_common(1)[0][0] if found else None
    if not is_inline_template(value):
        template = BUILTIN_TEMPLATES.get(value.strip())
        if template is None:
            names = ", ".join(sorted(BUILTIN_TEMPLATES))
            raise ConfigError(
                f"{source}: `chat_template`: unknown template {value!r} (use auto, one of {names}, or a Jinja template)"
            )
        return template
    try:
        import jinja2

        jinja2.Environment().parse(value)
    except ImportError:  # pragma: no cover - jinja2 comes with transformers, which tokenizer work requires
        pass
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{source}: `chat_template`: not a valid Jinja template ({exc.message})") from None
    return value
