"""Tiny random Llama / Qwen2 checkpoints built offline with transformers (a test-only dependency)."""

from __future__ import annotations

import pathlib

import torch

# Larger than transformers' default 0.02 so logits are well separated and greedy choices are
# not near-ties that float rounding could flip.
INIT_RANGE = 0.15


def save_tiny_llama(folder: pathlib.Path, *, llama3_rope: bool = True, seed: int = 0, vocab_size: int = 300,
                    max_positions: int = 512) -> pathlib.Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def save_tiny_qwen2(folder: pathlib.Path, *, seed: int = 1, max_shard_size: str | None = None) -> pathlib.Path:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = _tiny_qwen2_config(vocab_size=320, max_positions=512, eos=None, pad=0)
    model = Qwen2ForCausalLM(cfg).eval()
    # q/k/v biases start at zero; make them non-zero so the test can see a missing bias.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, **kwargs)
    return folder


# A Qwen2.5-style tool-calling chat template (ChatML; tools listed in the system turn; calls as
# <tool_call> JSON; tool results as <tool_response> in a user turn), written for these tests.
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- else %}
        {{- 'You are a helpful assistant.\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_TOOLS_CORPUS = [
    "You are a helpful assistant. What is the weather like in Paris today?",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    '{"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}}}',
    "The quick brown fox jumps over the lazy dog. Numbers 0123456789, true, false, null.",
]


def save_tiny_qwen2_tools(folder: pathlib.Path, *, seed: int = 3) -> pathlib.Path:
    """A tiny random Qwen2 with a byte-level BPE tokenizer and a Qwen2.5-style tool-calling template.

    `<tool_call>`/`</tool_call>` (and the `<tool_response>` pair) are added tokens that are *not*
    special, as in Qwen2.5: decoding keeps them, and a grammar matches them as plain text."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as BackendTokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_TOOLS_CORPUS, trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  chat_template=QWEN_TOOLS_TEMPLATE, clean_up_tokenization_spaces=False)
    tok.save_pretrained(folder)
    eos = backend.token_to_id("<|im_end|>")

    torch.manual_seed(seed)
    cfg = _tiny_qwen2_config(backend.get_vocab_size(with_added_tokens=True), 2048, eos,
                             backend.token_to_id("<|endoftext|>"))
    Qwen2ForCausalLM(cfg).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _tiny_qwen2_config(vocab_size: int, max_positions: int, eos: int | None, pad: int):
    """The tiny Qwen2 shape every Qwen2 checkpoint here shares (2 layers, GQA 4/2, tied embeddings)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        use_sliding_window=False,
    )
