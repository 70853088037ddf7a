"""Chat data in (issue 38): our rendering of a base model's chat template and its loss mask, checked
against transformers' `apply_chat_template` on the same tokenizer and template (transformers is the
outside reference: the trainer never imports it), and the lines that are not conversations."""

from __future__ import annotations

import io
import json

import pytest
from sft_helpers import CONVERSATIONS, FAMILIES, base_folder, reference_tokenizer
from trainer.prepare.chat import ChatCounts, ChatTokenizer, read_examples

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {family: base_folder(root / family, family) for family in FAMILIES}


def rendered_by_transformers(folder, conversation, **kwargs):
    try:
        return reference_tokenizer(folder).apply_chat_template(conversation, tokenize=False, **kwargs)
    except Exception as exc:  # the template's raise_exception: TemplateError
        return type(exc).__name__


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rendered_text_equals_transformers_for_every_conversation(folders, family):
    ours = ChatTokenizer(folders[family])
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            expected = rendered_by_transformers(folders[family], conversation, add_generation_prompt=prompt)
            try:
                text, _ = ours.render(conversation, add_generation_prompt=prompt)
            except Exception as exc:
                text = "TemplateError" if "refused" in str(exc) else repr(exc)
            assert text == expected, (family, conversation, prompt)


def conversations_for(family: str) -> list[list[dict]]:
    """CONVERSATIONS as the family's template takes them (Mistral's has no system role)."""
    if not family.startswith("mistral"):
        return CONVERSATIONS
    return [[m for m in c if m["role"] != "system"] for c in CONVERSATIONS]


@pytest.mark.parametrize("family", ["llama3-marked", "qwen2-marked", "mistral-marked"])
def test_assistant_mask_equals_return_assistant_tokens_mask(folders, family):
    ours = ChatTokenizer(folders[family])
    reference = reference_tokenizer(folders[family])
    assert ours.marked
    for conversation in conversations_for(family):
        example = ours.encode(conversation)
        expected = reference.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert example.ids.tolist() == expected["input_ids"]
        assert example.mask.tolist() == expected["assistant_masks"]
        assert 0 < example.mask.sum() < example.mask.size


@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral"])
def test_a_template_without_marks_targets_the_content_and_end_of_turn_as_the_marked_one_does(folders, family):
    """The published Llama 3 / Qwen2 / Mistral templates have no generation marks; our rule (content plus
    the end-of-turn token) gives the mask transformers finds with the marked version of the template."""
    ours = ChatTokenizer(folders[family])
    marked = reference_tokenizer(folders[f"{family}-marked"])
    assert not ours.marked
    for conversation in conversations_for(family):
        expected = marked.apply_chat_template(
            conversation, return_dict=True, return_assistant_tokens_mask=True
        )
        example = ours.encode(conversation)
        assert example.ids.tolist() == expected["input_ids"]
        assert example.mask.tolist() == expected["assistant_masks"]


def test_every_assistant_turn_is_a_target_and_nothing_else(folders):
    ours = ChatTokenizer(folders["qwen2"])
    example = ours.encode(CONVERSATIONS[1])
    decoded = ours.tokenizer.decode(
        example.ids[example.mask.astype(bool)].tolist(), skip_special_tokens=False
    )
    replies = [m["content"] for m in CONVERSATIONS[1] if m["role"] == "assistant"]
    assert decoded == "".join(r + "<|im_end|>" for r in replies)


def test_chat_template_jinja_beside_the_config_is_the_template_transformers_reads_first(tmp_path):
    folder = base_folder(tmp_path / "base", "qwen2-marked", template_file=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'not this one' }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = ChatTokenizer(folder)
    assert ours.template_from == "chat_template.jinja" and ours.marked
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.render(CONVERSATIONS[0])[0] == loaded.apply_chat_template(CONVERSATIONS[0], tokenize=False)


def test_named_templates_use_default(tmp_path):
    folder = base_folder(tmp_path / "base", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": config["chat_template"]},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert (
        ChatTokenizer(folder).render(CONVERSATIONS[0])[0].startswith("<|begin_of_text|><|start_header_id|>")
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({"eos_token": "</s>"}, "chat_template: missing"),
        (
            {"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m }"},
            "not a valid Jinja template",
        ),
        ({"chat_template": "{{ messages }}"}, "eos_token: missing"),
        ({"eos_token": "<nope>", "chat_template": "{{ messages }}"}, "'<nope>' is not a token"),
    ],
)
def test_a_base_folder_without_a_usable_template_is_one_line(tmp_path, config, message):
    folder = base_folder(tmp_path / "base", "llama3")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TrainstackError, match=message) as error:
        ChatTokenizer(folder)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "template", ["{% set ns = namespace(_secret=1) %}{{ messages }}", "{{ messages.__class__.__mro__ }}"]
)
def test_what_the_sandbox_refuses_stops_the_preparation_in_one_line(tmp_path, template):
    folder = base_folder(tmp_path / "base", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        TrainstackError, match="tokenizer_config.json: the chat template does what the sandbox"
    ):
        ChatTokenizer(folder).render(CONVERSATIONS[0])
    with pytest.raises(Exception, match="unsafe|underscore") as reference:
        reference_tokenizer(folder).apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert type(reference.value).__name__ == "SecurityError"  # transformers refuses it too


def test_a_template_that_fails_on_a_conversation_skips_that_line(folders, tmp_path):
    folder = base_folder(tmp_path / "base", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m.content + (1 if m.content == 'boom' else '') }}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    boom = [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "x"}]
    counts = ChatCounts()
    stream = io.BytesIO(
        "".join(json.dumps({"messages": c}) + "\n" for c in (boom, CONVERSATIONS[0])).encode()
    )
    kept = list(read_examples(stream, ChatTokenizer(folder), 4096, counts))
    assert [n for n, _, _ in kept] == [2]
    assert counts.first_skipped[0].startswith("line 1: the chat template failed on it (TypeError: ")


def test_lines_that_are_not_conversations_are_counted_and_named_by_line(folders):
    good = json.dumps({"messages": CONVERSATIONS[0]})
    lines = [
        good,
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"text": "pretraining text"}),
        json.dumps({"messages": [{"role": "user", "content": "no reply"}]}),
        json.dumps({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}),
        json.dumps(
            {"messages": [{"role": "user", "content": ["parts"]}, {"role": "assistant", "content": "y"}]}
        ),
        "",
        good,
    ]
    counts = ChatCounts()
    stream = io.BytesIO(("\n".join(lines) + "\n").encode())
    kept = list(read_examples(stream, ChatTokenizer(folders["qwen2"]), 4096, counts))
    assert [number for number, _, _ in kept] == [1, 9]
    assert counts.examples == 2 and counts.skipped_lines == 6 and counts.lines == 8
    assert counts.first_skipped == [
        "line 2: not JSON",
        "line 3: not a JSON object (a list)",
        "line 4: no 'messages' list",
        "line 5: no assistant turn",
        "line 6: messages[0].role: 'tool' is not one of system/user/assistant",
        "line 7: messages[0].content: a list, not a string",
    ]


def test_a_template_refusal_skips_the_line_with_the_templates_message(folders):
    counts = ChatCounts()
    record = {"messages": [{"role": "assistant", "content": "first"}, {"role": "user", "content": "then"}]}
    stream = io.BytesIO((json.dumps(record) + "\n").encode())
    assert not list(read_examples(stream, ChatTokenizer(folders["alternating"]), 4096, counts))
    assert counts.first_skipped == [
        "line 1: the chat template refused it: Conversation roles must alternate "
        "user/assistant/user/assistant/..."
    ]


def test_an_example_longer_than_seq_len_is_dropped_and_counted_never_cut(folders):
    ours = ChatTokenizer(folders["qwen2"])
    sizes = [ours.encode(c).ids.size for c in CONVERSATIONS]
    limit = sorted(sizes)[1]  # two fit, the others are longer
    counts = ChatCounts()
    stream = io.BytesIO("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS).encode())
    kept = list(read_examples(stream, ours, limit, counts))
    assert sorted(e.ids.size for _, _, e in kept) == sorted(s for s in sizes if s <= limit)
    assert counts.too_long == sum(s > limit for s in sizes) == len(sizes) - 2
    assert counts.skipped_lines == 0


def test_a_line_longer_than_the_record_bound_is_skipped_without_being_held(folders, monkeypatch):
    import trainer.prepare.chat as chat_module

    monkeypatch.setattr(chat_module, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(chat_module, "READ_BYTES", 64)
    good = json.dumps({"messages": CONVERSATIONS[0]})
    long = json.dumps(
        {"messages": [{"role": "user", "content": "x" * 5000}, {"role": "assistant", "content": "y"}]}
    )
    counts = ChatCounts()
    stream = io.BytesIO(f"{good}\n{long}\n{good}\n".encode())
    kept = list(read_examples(stream, ChatTokenizer(folders["qwen2"]), 4096, counts))
    assert [number for number, _, _ in kept] == [1, 3]
    assert counts.first_skipped == [
        f"line 2: a line of {len(long) + 1:,} bytes, over the 1,000-byte bound of one record"
    ]


def test_a_conversation_that_cannot_fit_is_dropped_without_being_tokenized(folders, monkeypatch):
    ours = ChatTokenizer(folders["qwen2"])
    encoded = []
    original = ours.tokenizer
    monkeypatch.setattr(
        ours,
        "tokenizer",
        type("Spy", (), {"encode": lambda s, t, **k: encoded.append(t) or original.encode(t, **k)})(),
    )
    huge = [{"role": "user", "content": "x" * 200_000}, {"role": "assistant", "content": "ok"}]
    counts = ChatCounts()
    stream = io.BytesIO(
        (json.dumps({"messages": huge}) + "\n" + json.dumps({"messages": CONVERSATIONS[0]}) + "\n").encode()
    )
    kept = list(read_examples(stream, ours, 512, counts))
    assert [n for n, _, _ in kept] == [2] and counts.too_long == 1
    assert len(encoded) == 1 and len(encoded[0]) < 1000  # only the conversation that fits was encoded
