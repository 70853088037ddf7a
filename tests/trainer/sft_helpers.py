"""Small base-model folders for the fine-tuning tests: a byte-level BPE tokenizer (or a SentencePiece-style
one) trained here with the `tokenizers` library (no hub access), its tokenizer_config.json, and chat
templates written after the published Llama 3, Qwen2 and Mistral ones, with and without
`{% generation %}` marks."""

from __future__ import annotations

import json
from pathlib import Path

# Meta-Llama-3-8B-Instruct's template (tokenizer_config.json), as published.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# The same with the assistant's reply and its <|eot_id|> marked, as TRL's assistant_only_loss needs.
LLAMA3_MARKED = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2-7B-Instruct's template, as published (a default system prompt when there is none).
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_MARKED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# What the environment offers beyond plain Jinja: namespace, strftime_now, tojson (HTML left alone),
# raise_exception, loop controls, dict (Llama 3.1's and Mistral's templates use these).
FEATURES = (
    "{% set ns = namespace(turns=0) %}{{ bos_token }}{{ strftime_now('%Y') | length }}"
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role ' + message['role']) }}{% endif %}"
    "{% if message['content'] == 'SKIP' %}{% continue %}{% endif %}{% set ns.turns = ns.turns + 1 %}"
    "[{{ message['role'] | upper }}]{{ {'c': message['content']} | tojson }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{{ dict(turns=ns.turns) | tojson }}"
)
# Mistral-7B-Instruct-v0.1's template, as published (no system role; the reply straight after [/INST]),
# for a SentencePiece-style tokenizer (Metaspace, byte fallback).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
MISTRAL_MARKED = MISTRAL.replace(
    "{{ message['content'] + eos_token}}",
    "{% generation %}{{ message['content'] + eos_token}}{% endgeneration %}",
)
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}{% endfor %}"
)

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "</s>",
]
SENTENCEPIECE_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
CORPUS = [
    "You are a helpful assistant. What is the capital of France? The capital of France is Paris.",
    "system user assistant Hello! How can I help you today? Tell me a joke about cats, please.",
    "Why did the cat sit on the computer? To keep an eye on the mouse. Thanks, that was funny!",
    "def add(a, b):\n    return a + b\n\nThe function adds two numbers and returns the sum.",
    'Ünïcödé tëxt: café, naïve, 東京, emoji 🙂 and {"json": [1, 2]} <b>html</b> & more.',
]
FAMILIES = {
    # name: (template, bos, eos, pad)
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", None),
    "llama3-marked": (LLAMA3_MARKED, "<|begin_of_text|>", "<|eot_id|>", None),
    "qwen2": (QWEN2, None, "<|im_end|>", "<|endoftext|>"),
    "qwen2-marked": (QWEN2_MARKED, None, "<|im_end|>", "<|endoftext|>"),
    "features": (FEATURES, "<|begin_of_text|>", "</s>", None),
    "alternating": (ALTERNATING, None, "</s>", None),
    "mistral": (MISTRAL, "<s>", "</s>", None),
    "mistral-marked": (MISTRAL_MARKED, "<s>", "</s>", None),
}
CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [  # multi-turn, no system prompt
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke about cats, please."},
        {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse."},
        {"role": "user", "content": "Thanks, that was funny!"},
        {"role": "assistant", "content": "  You're welcome.  \n"},
    ],
    [
        {"role": "system", "content": "Answer with code."},
        {"role": "user", "content": "def add(a, b):"},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    ],
    [
        {"role": "user", "content": 'Ünïcödé: café 東京 🙂 {"json": [1, 2]} <b>html</b> & more'},
        {"role": "assistant", "content": "naïve 🙂 <b>ok</b> & done"},
    ],
    [  # replies that the role headers contain ("assistant", "system"): found after the header only
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Say a letter."},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "Now a longer word."},
        {"role": "assistant", "content": "assist"},
    ],
]


def tokenizer(vocab_size: int = 600, sentencepiece: bool = False):
    """A byte-level BPE (GPT-2, Llama 3, Qwen2 style), or with `sentencepiece` a Metaspace BPE with byte
    fallback (Llama 2, Mistral style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if sentencepiece:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SENTENCEPIECE_SPECIALS)
        tok.train_from_iterator(CORPUS * 20, trainer)
        return tok
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def base_folder(folder: Path, family: str, template_file: bool = False) -> Path:
    """A base model's tokenizer files for `family` (FAMILIES): tokenizer.json and tokenizer_config.json
    (the template in it, or in chat_template.jinja beside it)."""
    template, bos, eos, pad = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(sentencepiece=family.startswith("mistral")).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
    }
    if template_file:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder


def reference_tokenizer(folder: Path):
    """transformers' tokenizer over the same tokenizers object and template (the outside reference)."""
    import transformers
    from tokenizers import Tokenizer

    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (folder / "chat_template.jinja").read_text()
    specials = {k: v for k in ("bos_token", "eos_token", "pad_token") if (v := config.get(k)) is not None}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
        chat_template=template,
        **specials,
    )


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps({"messages": r}, ensure_ascii=False) for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
