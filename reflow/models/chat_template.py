"""The Qwen-style chat template and special tokens shared by the model presets.

The template follows Qwen2.5/Qwen3's ChatML layout so that a model trained here can be served by any
engine that knows Qwen (SGLang, vLLM) and so that the Hermes tool-call parser in `reflow.env.parsers`
reads what it writes:

    <|im_start|>system\\n{system}\\n\\n# Tools ... <tools>{schemas}</tools> ...<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n[<think>\\n{reasoning}\\n</think>\\n\\n]{content}[\\n]<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call><|im_end|>\\n
    <|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>\\n<tool_response>...<|im_end|>\\n
    <|im_start|>assistant\\n                        (add_generation_prompt)

Deliberate differences from Qwen3, so that a conversation re-rendered after each turn extends what was
sampled (token-in-token-out needs that):
- assistant reasoning is kept in every past turn;
- an assistant message's `content` is written verbatim: a raw completion with its own `<think>...</think>`
  and `<tool_call>` text renders exactly as sampled (Qwen3 re-formats the think block);
  `reasoning_content` and `tool_calls`, when given, render in the canonical Qwen layout.
Pass `drop_past_reasoning=True` to `apply_chat_template` for Qwen3's own behaviour (reasoning of
assistant turns before the last real user query is dropped, from `reasoning_content` or from the
content's think block); that breaks the prefix property across user turns, exactly as the real Qwen3
template does. `enable_thinking=False` appends an empty think block to the generation prompt, as Qwen3
does.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

# Control tokens: never produced by decoding with skip_special_tokens=True.
CONTROL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
# Markup tokens: single ids (so the model emits a tool call with one token) but ordinary text when decoded,
# as in Qwen's tokenizer, so `skip_special_tokens=True` keeps the tool-call markup the parser needs.
MARKUP_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + MARKUP_TOKENS

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- set drop = drop_past_reasoning and loop.index0 < ns.last_query_index %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif drop and '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if reasoning and not drop %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
