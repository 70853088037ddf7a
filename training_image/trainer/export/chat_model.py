"""A chat model out: the generation settings that make an exported fine-tune stop at the end of its turn.

A Hub chat model is a folder whose tokenizer files carry the chat template (tokenizer_config.json's
`chat_template` and/or `chat_template.jinja`) and whose generation_config.json lists, among its
`eos_token_id`s, the token that ends an assistant turn: Qwen2.5-7B-Instruct lists `<|im_end|>` (151645)
beside `<|endoftext|>`, Llama-3.1-8B-Instruct `<|eot_id|>` (128009) beside `<|end_of_text|>` and
`<|eom_id|>`. transformers' `generate` stops at any of them (GenerationConfig.eos_token_id, an int or a
list), and vLLM adds them to its stop tokens (it reads generation_config.json). A base model's folder
names only its end-of-document token: a model fine-tuned from it with that generation_config writes its
reply, the end-of-turn token, and then goes on with a next turn of its own invention.

The tokenizer files are copied as they are (trainer.export.hf_folder), so the template the export
ships is the base's: the one `data prepare --format chat` rendered the conversations with. The
end-of-turn token is found by that same rendering (trainer.prepare.chat), not by a list of known
names: a probe conversation is rendered and tokenized as the training data was, and the last token of
its assistant reply that the model was trained to produce (the last target of the loss mask: the
template's `{% generation %}` span, or the content plus the first special token after it) is the token
generation must stop at, when it is a special token.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.prepare.chat import ChatTokenizer, SkippedLine
from trainstack.errors import TrainstackError

log = logging.getLogger("trainer.export")

# Probe conversations, the plainest first; a template may refuse one (a required system prompt, roles
# that must alternate from a user turn), so the next is tried.
PROBES = (
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
    ],
)
# Written by transformers when it saves a generation config; not settings of the model.
BOOKKEEPING = ("transformers_version", "_from_model_config")


def end_of_turn(tokenizer_dir: Path) -> tuple[int, str] | None:
    """(id, text) of the token an assistant turn ends with under the folder's chat template, as the
    training data marked it; None when no probe renders or the reply's last target is not a special
    token (a template that ends replies with plain text has no token to stop at). Raises
    TrainstackError when the folder has no chat template or no usable tokenizer.json."""
    chat = ChatTokenizer(tokenizer_dir)
    for probe in PROBES:
        try:
            example = chat.encode(probe)
        except SkippedLine:
            continue
        last = int(example.ids[example.mask.nonzero()[0][-1]])
        if last not in chat.special_ids:
            return None
        return last, chat.tokenizer.id_to_token(last)
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def export_generation_config(
    model_config: dict[str, Any], base_generation: dict[str, Any] | None, end_of_turn_id: int | None
) -> dict[str, Any]:
    """generation_config.json of the export: the base folder's own (its sampling defaults, as
    `save_pretrained` of a fine-tuned model keeps them), the token ids of the exported config.json over
    it, and `eos_token_id` the union of the base's, the config's and the end-of-turn token (first, as
    the Instruct releases list it), a plain int when there is one."""
    out = {k: v for k, v in (base_generation or {}).items() if k not in BOOKKEEPING}
    for key in ("bos_token_id", "pad_token_id"):
        if model_config.get(key) is not None:
            out[key] = model_config[key]
    eos: list[int] = []
    for found in (
        [end_of_turn_id] if end_of_turn_id is not None else [],
        _ids(out.get("eos_token_id")),
        _ids(model_config.get("eos_token_id")),
    ):
        eos += [i for i in found if i not in eos]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    else:
        out.pop("eos_token_id", None)
    return out


def chat_end_of_turn(tokenizer_dir: Path | None, vocab: int, source: str | None = None) -> tuple[int, str]:
    """The end-of-turn token for a fine-tuned (sft) export, checked against the model's vocabulary;
    one TrainstackError line when the shipped tokenizer cannot say (a chat model that never stops is
    not an export to hand anyone). `tokenizer_dir`: the local copy of the files shipped from `source`."""
    if tokenizer_dir is None:
        raise TrainstackError(
            "export: a fine-tuned (training.objective sft) model needs its tokenizer files with the chat "
            "template, and none were shipped: pass --tokenizer (or set export.tokenizer) to the base "
            "model's folder"
        )
    source = source or str(tokenizer_dir)
    try:
        found = end_of_turn(tokenizer_dir)
    except TrainstackError as error:  # no template, no tokenizer.json: named as shipped, not the copy's path
        detail = str(error).replace(str(tokenizer_dir), source.rstrip("/"))
        raise TrainstackError(
            f"export: a fine-tuned (training.objective sft) model ships its chat template, and the tokenizer "
            f"files from {source} cannot give one: {detail}"
        ) from None
    if found is None:
        raise TrainstackError(
            f"export: the chat template shipped from {source} ends an assistant reply with no special "
            "token: generation would not stop at the end of a turn (give a template that ends each reply "
            "with one, such as <|im_end|> or <|eot_id|>)"
        )
    if found[0] >= vocab:
        raise TrainstackError(
            f"export: the end-of-turn token {found[1]!r} is id {found[0]}, outside the model's vocabulary of "
            f"{vocab} (model.vocab): the shipped tokenizer is not the model's"
        )
    log.info("end of turn: %r (id %d) added to generation_config.json's eos_token_id", found[1], found[0])
    return found
