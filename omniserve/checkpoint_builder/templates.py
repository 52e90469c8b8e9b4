"""Chat templates of the model families, written as Jinja the way the real checkpoints render."""

from __future__ import annotations

import textwrap

# ChatML as Qwen2-VL / Qwen3-Omni render it: string content, or a list of typed parts where media
# parts become their placeholder spans (the processor later expands the pad token per item).
# Every tag opens with "-" so the newlines and indents here never reach the rendered prompt.
CHATML_TEMPLATE = textwrap.dedent("""
    {%- for message in messages %}
        {%- if loop.first and message['role'] != 'system' %}
            {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
        {%- endif %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {%- if part['type'] in ('image', 'image_url') %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('video', 'video_url') %}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('audio', 'audio_url', 'input_audio') %}
                    {{- '<|audio_start|><|audio_pad|><|audio_end|>' }}
                {%- elif part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}
""").strip()

# Qwen2-Audio-Instruct's ChatML: each audio part is numbered and ends its own line, as the real
# template renders it ("Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\n").
QWEN2_AUDIO_TEMPLATE = textwrap.dedent("""
    {%- set audio_count = namespace(value=0) %}
    {%- for message in messages %}
        {%- if loop.first and message['role'] != 'system' %}
            {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
        {%- endif %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {%- if part['type'] in ('audio', 'audio_url', 'input_audio') %}
                    {%- set audio_count.value = audio_count.value + 1 %}
                    {{- 'Audio ' ~ audio_count.value ~ ': ' }}
                    {{- '<|audio_bos|><|AUDIO|><|audio_eos|>\\n' }}
                {%- elif part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}
""").strip()

# Qwen2.5-Omni's ChatML: images and videos inside <|vision_bos|>..<|vision_eos|> with the upper-case
# pads, audio inside <|audio_bos|>..<|audio_eos|>; "Picture N: " / "Audio N: " only on request
# (add_vision_id / add_audio_id), as the real template renders them.
QWEN2_5_OMNI_TEMPLATE = textwrap.dedent("""
    {%- set counts = namespace(image=0, video=0, audio=0) %}
    {%- for message in messages %}
        {%- if loop.first and message['role'] != 'system' %}
            {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
        {%- endif %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {%- if part['type'] in ('image', 'image_url') %}
                    {%- set counts.image = counts.image + 1 %}
                    {%- if add_vision_id %}{{- 'Picture ' ~ counts.image ~ ': ' }}{%- endif %}
                    {{- '<|vision_bos|><|IMAGE|><|vision_eos|>' }}
                {%- elif part['type'] in ('video', 'video_url') %}
                    {%- set counts.video = counts.video + 1 %}
                    {%- if add_vision_id %}{{- 'Video ' ~ counts.video ~ ': ' }}{%- endif %}
                    {{- '<|vision_bos|><|VIDEO|><|vision_eos|>' }}
                {%- elif part['type'] in ('audio', 'audio_url', 'input_audio') %}
                    {%- set counts.audio = counts.audio + 1 %}
                    {%- if add_audio_id %}{{- 'Audio ' ~ counts.audio ~ ': ' }}{%- endif %}
                    {{- '<|audio_bos|><|AUDIO|><|audio_eos|>' }}
                {%- elif part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}
""").strip()

# Qwen3-Omni's ChatML: no default system turn (as Qwen3), lower-case pads inside
# <|vision_start|>..<|vision_end|> and <|audio_start|>..<|audio_end|>.
QWEN3_OMNI_TEMPLATE = textwrap.dedent("""
    {%- set counts = namespace(image=0, video=0, audio=0) %}
    {%- for message in messages %}
        {{- '<|im_start|>' + message['role'] + '\\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] }}
        {%- else %}
            {%- for part in message['content'] %}
                {%- if part['type'] in ('image', 'image_url') %}
                    {%- set counts.image = counts.image + 1 %}
                    {%- if add_vision_id %}{{- 'Picture ' ~ counts.image ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('video', 'video_url') %}
                    {%- set counts.video = counts.video + 1 %}
                    {%- if add_vision_id %}{{- 'Video ' ~ counts.video ~ ': ' }}{%- endif %}
                    {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
                {%- elif part['type'] in ('audio', 'audio_url', 'input_audio') %}
                    {%- set counts.audio = counts.audio + 1 %}
                    {%- if add_audio_id %}{{- 'Audio ' ~ counts.audio ~ ': ' }}{%- endif %}
                    {{- '<|audio_start|><|audio_pad|><|audio_end|>' }}
                {%- elif part['type'] == 'text' %}
                    {{- part['text'] }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endfor %}
    {%- if add_generation_prompt %}
        {{- '<|im_start|>assistant\\n' }}
    {%- endif %}
""").strip()

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
