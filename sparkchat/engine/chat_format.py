"""Ling's chat format as a template of our own, for the models we build (the tiny test models and the
demo model). Real checkpoints ship their own template, which the tokenizer renders instead."""

EOS = "<|endoftext|>"
ROLE_END = "<|role_end|>"
PAD = "<|pad|>"
# Order fixes the ids: the specials come first, so `<|endoftext|>` is 0, `<|role_end|>` 1, and so on.
SPECIAL_TOKENS = [EOS, ROLE_END, "<role>", "</role>", "<think>", "</think>", PAD]

# Ling's format: `<role>X</role>` opens a turn, `<|role_end|>` closes it; the generation prompt opens
# the assistant turn and either leaves `<think>` open (thinking on) or closes it empty (thinking off).
# Past assistant turns keep only their answer, as reasoning models usually drop old thoughts.
CHAT_TEMPLATE = """\
{%- set role_names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT', 'tool': 'OBSERVATION'} -%}
{%- for message in messages -%}
    {%- if message.role not in role_names -%}
        {{- raise_exception('unknown role: ' ~ message.role) -}}
    {%- endif -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if message.role == 'assistant' and '</think>' in content -%}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {{- '<role>' ~ role_names[message.role] ~ '</role>' ~ content ~ '<|role_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<role>ASSISTANT</role>\\n<think>' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '</think>' -}}
    {%- endif -%}
{%- endif -%}
"""
