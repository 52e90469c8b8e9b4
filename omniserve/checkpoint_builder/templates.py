"""Chat templates of the model families, written as Jinja the way the real checkpoints render."""

from __future__ import annotations

import textwrap

# The ChatML skeleton the Qwen family's templates share (Qwen2.5 / Qwen3 layout): with `tools`,
# a system turn lists them as JSON inside <tools></tools> (the caller's system text first);
# assistant `tool_calls` render as <tool_call>{"name", "arguments"}</tool_call> blocks (the hermes
# format; arguments as given: a JSON string as is, an object as JSON); consecutive `tool` messages
# share one user turn of <tool_response> blocks. {system} adds a default system turn (or is ""),
# {part} renders one typed content part named `part`, {thinking} follows the generation prompt.
# Every tag opens with "-" so the newlines and indents here never reach the rendered prompt.
_CHATML = textwrap.dedent("""
    {%- set counts = namespace(image=0, video=0, audio=0) %}
    {%- if tools %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0]['role'] == 'system' %}
            {%- if messages[0]['content'] is string %}
                {{- messages[0]['content'] }}
            {%- else %}
                {%- for part in messages[0]['content'] if part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endfor %}
            {%- endif %}
            {{- '\\n\\n' }}
        {%- endif %}
        {{- '# Tools\\n\\nYou may call one or more functions to assist with the user '
            'query.\\n\\nYou are provided with function signatures within <tools></tools> '
            'XML tags:\\n<tools>' }}
        {%- for tool in tools %}
            {{- '\\n' + (tool | tojson) }}
        {%- endfor %}
        {{- '\\n</tools>\\n\\nFor each function call, return a json object with function '
            'name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
            '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
            '<|im_end|>\\n' }}
    {system}
    {%- endif %}
    {%- set shown = messages[1:] if tools and messages[0]['role'] == 'system' else messages %}
    {%- for message in shown %}
        {%- set first_tool = message['role'] == 'tool' and (loop.first
            or loop.previtem['role'] != 'tool') %}
        {%- if message['role'] != 'tool' %}
            {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- elif first_tool %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {%- if message['role'] == 'tool' %}
            {{- '\\n<tool_response>\\n' }}
        {%- endif %}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {part}
            {%- endfor %}
        {%- endif %}
        {%- if message['role'] == 'tool' %}
            {{- '\\n</tool_response>' }}
            {%- if loop.last or loop.nextitem['role'] != 'tool' %}
                {{- '<|im_end|>\\n' }}
            {%- endif %}
        {%- else %}
            {%- for call in message['tool_calls'] or [] %}
                {%- set call = call['function'] if call['function'] is defined else call %}
                {%- if message['content'] or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + call['name'] + '", "arguments": ' }}
                {{- call['arguments'] if call['arguments'] is string
                    else call['arguments'] | tojson }}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
        {thinking}
    {%- endif %}
""").strip()

_DEFAULT_SYSTEM = """{%- elif messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"""

# Qwen3's thinking switch: `enable_thinking=False` closes an empty thinking block for the model.
_THINKING_SWITCH = """{%- if enable_thinking is defined and enable_thinking is false %}
            {{- '<think>\\n\\n</think>\\n\\n' }}
        {%- endif %}"""


def _chatml(part: str, *, system: str = _DEFAULT_SYSTEM, thinking: str = "") -> str:
    return (
        _CHATML.replace("{system}", system)
        .replace("{part}", textwrap.dedent(part).strip())
        .replace("{thinking}", thinking)
    )


def _media_part(image: str, video: str, audio: str, numbered: bool = True) -> str:
    """One content part: a media part as its placeholder span ("Picture N: " / "Video N: " /
    "Audio N: " before it when the caller asks with add_vision_id / add_audio_id), text as is."""
    labels = {"image": "Picture", "video": "Video", "audio": "Audio"}
    spans = {"image": image, "video": video, "audio": audio}
    switch = {"image": "add_vision_id", "video": "add_vision_id", "audio": "add_audio_id"}
    branches = []
    for modality, span in spans.items():
        label = (
            f"{{%- if {switch[modality]} %}}{{{{- '{labels[modality]} ' ~ counts.{modality}"
            f" ~ ': ' }}}}{{%- endif %}}"
            if numbered
            else ""
        )
        branches.append(
            f"if part['type'] in ('{modality}', '{modality}_url'"
            f"{', ' + repr('input_audio') if modality == 'audio' else ''}) %}}"
            f"{{%- set counts.{modality} = counts.{modality} + 1 %}}{label}{{{{- '{span}' }}}}"
        )
    return (
        "{%- "
        + "{%- el".join(branches)
        + "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    )


# ChatML as Qwen2-VL / Qwen2.5 render it: a default system turn; media parts become their
# placeholder spans (the processor later expands the pad token per item).
CHATML_TEMPLATE = _chatml(
    _media_part(
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|vision_start|><|video_pad|><|vision_end|>",
        "<|audio_start|><|audio_pad|><|audio_end|>",
        numbered=False,
    )
)

# Qwen3's: no default system turn, and the thinking switch.
QWEN3_TEMPLATE = _chatml(
    _media_part(
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|vision_start|><|video_pad|><|vision_end|>",
        "<|audio_start|><|audio_pad|><|audio_end|>",
        numbered=False,
    ),
    system="",
    thinking=_THINKING_SWITCH,
)

# Qwen2-Audio-Instruct's: each audio part is numbered and ends its own line, as the real
# template renders it ("Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n").
QWEN2_AUDIO_TEMPLATE = _chatml("""
    {%- if part['type'] in ('audio', 'audio_url', 'input_audio') %}
        {%- set counts.audio = counts.audio + 1 %}
        {{- 'Audio ' ~ counts.audio ~ ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}
    {%- elif part['type'] == 'text' %}
        {{- part['text'] }}
    {%- endif %}""")

# Qwen2.5-Omni's: images and videos inside <|vision_bos|>..<|vision_eos|> with the upper-case
# pads, audio inside <|audio_bos|>..<|audio_eos|>; "Picture N: " / "Audio N: " only on request.
QWEN2_5_OMNI_TEMPLATE = _chatml(
    _media_part(
        "<|vision_bos|><|IMAGE|><|vision_eos|>",
        "<|vision_bos|><|VIDEO|><|vision_eos|>",
        "<|audio_bos|><|AUDIO|><|audio_eos|>",
    )
)

# Qwen3-Omni's: no default system turn (as Qwen3), lower-case pads inside
# <|vision_start|>..<|vision_end|> and <|audio_start|>..<|audio_end|>.
QWEN3_OMNI_TEMPLATE = _chatml(
    _media_part(
        "<|vision_start|><|image_pad|><|vision_end|>",
        "<|vision_start|><|video_pad|><|vision_end|>",
        "<|audio_start|><|audio_pad|><|audio_end|>",
    ),
    system="",
)

LLAMA3_TEMPLATE = textwrap.dedent("""
    {{- bos_token }}
    {%- for message in messages %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] | trim }}
        {%- else %}
            {%- for part in message['content'] if part['type'] == 'text' %}
                {{- part['text'] | trim }}
            {%- endfor %}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- endif %}
""").strip()
