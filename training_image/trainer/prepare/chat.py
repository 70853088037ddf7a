"""Conversations in, token ids and a loss mask out: the base model's own chat template, rendered as
transformers renders it, without importing transformers (the training image never installs it).

Input: JSONL, one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}` (the form
TRL's SFTTrainer, torchtune and OpenAI's fine-tuning read), roles `system`, `user`, `assistant`, content a
string. Other keys of a line or a message are not passed to the template (what renders is fixed by
role and content alone).

**The template.** BASE_DIR's `chat_template.jinja` when it has one (transformers writes the template
there since 4.43 and reads it first), else `chat_template` in its tokenizer_config.json: a string, or a
list of `{name, template}` of which `default` is used (what `get_chat_template` picks without tools).
It renders in the Jinja environment transformers' `apply_chat_template` builds
(transformers 5.23.0, utils/chat_template_utils.py `_cached_compile_jinja_template`): an
ImmutableSandboxedEnvironment (chat templates are untrusted code from a model's folder) with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` extension,
`tojson` that does not escape HTML and takes indent/separators/sort_keys, the globals
`raise_exception` (a TemplateError with the template's message), `strftime_now`, a `dict` and a
`namespace` that refuses underscore names; the variables are `messages`, `tools` (None), `documents`
(None), `add_generation_prompt` (False for training data) and the tokenizer's named special tokens
(`bos_token`, `eos_token`, ... from tokenizer_config.json, else special_tokens_map.json), as
`special_tokens_map` gives them. jinja2 older than 3.1.6 is refused as transformers refuses it (known
sandbox escapes).

**Tokens.** The rendered text is encoded with BASE_DIR's tokenizer.json by the `tokenizers` library,
without adding special tokens (the template writes them), as `apply_chat_template` encodes it.

**Targets** (`mask[j] = 1`: token j is one the model learns to produce):

- A template with `{% generation %}...{% endgeneration %}` marks: the tokens of the text each mark
  spans, found as `return_assistant_tokens_mask` finds them: the token holding the span's first
  character through the token holding its last (`Encoding.char_to_token`), the same quirks included (a
  span whose first character is in no token ends the search; one whose last is in no token, or in
  token 0, runs to the end).
- A template without the marks (most published ones): each assistant turn's content, found in the
  rendered text (verbatim, else stripped of surrounding white space, as templates that `| trim` it
  render it) after the previous message's and after the turn's own header (where the rendering starts
  with the conversation before the turn rendered with the generation prompt, as it does for the
  published templates), plus the end-of-turn token: the first special token of the
  tokenizer after the content (`<|eot_id|>`, `<|im_end|>`, `</s>`) with the white-space-only tokens
  before it (Llama 2's `content + ' ' + eos_token`: the model must learn the space too). Where a
  non-space token comes first there is no end-of-turn token to learn and only the content is a target.
  A template that rewrites assistant content (so it is not found) makes that line a skipped one, named.

**Lines that are not a conversation** (invalid JSON, not an object, no `messages` list, a message that
is not `{role, content}` strings with a known role, no assistant turn, a template's own
`raise_exception`, no target token, longer than trainer.prepare.inputs.MAX_RECORD_BYTES: one line is
read whole, so it is bounded as the pretraining path bounds a record) are skipped and counted by
reason, the first ones with their line numbers. An example longer than `seq_len` tokens is dropped and
counted, never cut (a cut conversation teaches a reply that stops mid-sentence, or loses its targets).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.prepare.inputs import MAX_RECORD_BYTES, READ_BYTES
from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    import numpy as np

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
TOKENIZER_FILE = "tokenizer.json"
ROLES = ("system", "user", "assistant")
# transformers' SPECIAL_TOKENS_ATTRIBUTES (5.23.0): what `special_tokens_map` passes to the template.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
GENERATION_MARK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # the test transformers makes for the marks
MIN_JINJA = (3, 1, 6)
FIRST_SKIPPED = 20  # skipped lines named one by one in the report (all are counted)


class SkippedLine(Exception):
    """A line that is not a usable conversation; the message is the reason, without the line number."""


class TooLong(Exception):
    """A conversation whose rendered text is certainly longer than the token limit (not tokenized)."""


# --- the template ------------------------------------------------------------------------------------


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TrainstackError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise TrainstackError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def find_template(base: Path) -> tuple[str, str]:
    """(template source, where it came from) of the base folder, in transformers' order of precedence."""
    jinja_file = base / TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), TEMPLATE_FILE
    config_path = base / CONFIG_FILE
    if not config_path.is_file():
        raise TrainstackError(
            f"--tokenizer {base}: no {TEMPLATE_FILE} and no {CONFIG_FILE}: the base model's chat template "
            "is not there (give the base model's folder)"
        )
    template = _load_json(config_path).get("chat_template")
    if isinstance(template, list):  # named templates: [{name, template}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise TrainstackError(
                f"{config_path}: chat_template: named templates {sorted(map(str, named))} and none is "
                "'default'"
            )
    if not isinstance(template, str) or not template.strip():
        raise TrainstackError(
            f"{config_path}: chat_template: missing (a base model without a chat template; add one, or its "
            f"{TEMPLATE_FILE})"
        )
    return template, f"{CONFIG_FILE} chat_template"


def special_tokens(base: Path) -> dict[str, str]:
    """The named special tokens the template sees (transformers' `special_tokens_map`)."""
    found: dict[str, str] = {}
    for name in (SPECIAL_TOKENS_FILE, CONFIG_FILE):  # the config wins where both name a token
        path = base / name
        if path.is_file():
            data = _load_json(path)
            for key in SPECIAL_TOKEN_NAMES:
                text = _token_text(data.get(key))
                if text is not None:
                    found[key] = text
    return found


def _jinja():
    import jinja2

    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < MIN_JINJA:
        raise TrainstackError(
            f"jinja2 {jinja2.__version__}: chat templates need jinja2 >= 3.1.6 (older versions have known "
            "sandbox escapes, and a chat template is code from the model's folder)"
        )
    return jinja2


def compile_template(source: str, where: str = "chat_template"):
    """The template compiled in transformers' environment (module doc); one line for a syntax error."""
    _jinja()  # the version check
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body and, while a tracker is active,
        records the body's (start, end) character span in the output (transformers' AssistantTracker)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks: list[str] | None = None
            self._spans: list[tuple[int, int]] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context, caller) -> str:
            text = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(text)))
            return text

        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            tracker = self

            class _Active:
                def __enter__(self):
                    tracker._blocks, tracker._spans = blocks, spans

                def __exit__(self, *exc):
                    tracker._blocks = tracker._spans = None

            return _Active()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change what the model sees.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # A callable, not the `dict` type itself: the type's attributes would reach Python internals.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Underscore names refused: dunder attributes on a namespace lead to CPython internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                    f"{name!r}."
                )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TrainstackError(
            f"{where}: not a valid Jinja template (line {exc.lineno}: {exc.message})"
        ) from None


def render(
    template, messages: list[dict], variables: dict[str, str], add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans of its `{% generation %}` blocks)."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with template.environment.track_generation(blocks, spans):
        for block in template.generate(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        ):
            blocks.append(block)
    return "".join(blocks), spans


# --- conversations -----------------------------------------------------------------------------------


def conversation(line: bytes) -> list[dict]:
    """The messages of one JSONL line (role and content only), or SkippedLine saying why not."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise SkippedLine("not UTF-8") from None
    except json.JSONDecodeError:
        raise SkippedLine("not JSON") from None
    except RecursionError:
        raise SkippedLine("nested deeper than the JSON parser allows") from None
    if not isinstance(record, dict):
        raise SkippedLine(f"not a JSON object (a {type(record).__name__})")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SkippedLine("no 'messages' list" if not isinstance(messages, list) else "'messages' is empty")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SkippedLine(f"messages[{i}]: not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise SkippedLine(f"messages[{i}].role: {role!r} is not one of {'/'.join(ROLES)}")
        if not isinstance(content, str):
            raise SkippedLine(f"messages[{i}].content: a {type(content).__name__}, not a string")
        chat.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in chat):
        raise SkippedLine("no assistant turn")
    return chat


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # int64 token ids of the rendered conversation
    mask: np.ndarray  # uint8, 1 where the token is a target


class ChatTokenizer:
    """A base folder's chat template and tokenizer: conversation -> Example (module doc)."""

    def __init__(self, base: Path):
        self.base = Path(base)
        if not self.base.is_dir():
            raise TrainstackError(f"--tokenizer {base}: not a directory (give the base model's folder)")
        self.source, self.template_from = find_template(self.base)
        self.template_sha256 = hashlib.sha256(self.source.encode("utf-8")).hexdigest()
        self.template = compile_template(self.source, str(self.base / self.template_from.split()[0]))
        self.variables = special_tokens(self.base)
        self.marked = bool(GENERATION_MARK.search(self.source))
        tokenizer_path = self.base / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise TrainstackError(f"--tokenizer {base}: no {TOKENIZER_FILE} in the base folder")
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the library raises a bare Exception for a file it cannot parse
            detail = " ".join(str(exc).split())[:160]
            raise TrainstackError(
                f"{tokenizer_path}: not a tokenizer.json the tokenizers library reads ({detail})"
            ) from None
        self.tokenizer_path = tokenizer_path
        self.vocab_size = self.tokenizer.get_vocab_size(True)
        # Characters one token can stand for, at most (twice the longest token string: normalizers such
        # as NFKC can expand a character), so a text longer than limit * this has more than `limit` tokens.
        self.max_token_chars = 2 * max(len(t) for t in self.tokenizer.get_vocab(True))
        self.special_ids = frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        )
        eos = self.variables.get("eos_token")
        self.eos_id = self.tokenizer.token_to_id(eos) if eos is not None else None
        if self.eos_id is None:
            raise TrainstackError(
                f"{self.base / CONFIG_FILE}: eos_token: {eos!r} is not a token of {TOKENIZER_FILE}"
                if eos is not None
                else f"{self.base / CONFIG_FILE}: eos_token: missing (the base model's end-of-sequence token)"
            )
        self.targets_rule = (
            "the template's {% generation %} marks"
            if self.marked
            else "assistant content plus the end-of-turn token (the template has no generation marks)"
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list]:
        jinja2 = _jinja()
        try:
            return render(self.template, messages, self.variables, add_generation_prompt)
        except jinja2.exceptions.SecurityError as exc:  # the template, not the line: stop, in one line
            raise TrainstackError(
                f"{self.base / self.template_from.split()[0]}: the chat template does what the sandbox "
                f"refuses ({' '.join(str(exc).split())[:200]})"
            ) from None
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, an undefined name, ...
            raise SkippedLine(f"the chat template refused it: {' '.join(str(exc).split())[:200]}") from None
        except Exception as exc:  # e.g. a TypeError of the template's own expressions on this conversation
            detail = " ".join(str(exc).split())[:200]
            raise SkippedLine(f"the chat template failed on it ({type(exc).__name__}: {detail})") from None

    def encode(self, messages: list[dict], max_tokens: int | None = None) -> Example:
        """The conversation's ids and mask; TooLong, without tokenizing, when its text cannot fit in
        `max_tokens` (the tokenizer holds ~100 bytes per character of one text: a multi-megabyte
        conversation, which no training sequence holds anyway, is never encoded)."""
        import numpy as np

        text, spans = self.render(messages)
        if max_tokens is not None and len(text) > max_tokens * self.max_token_chars:
            raise TooLong
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if self.marked:
            mask = assistant_mask(encoding, spans, len(ids))
        else:
            mask = self._unmarked_mask(encoding, text, messages, len(ids))
        if not mask.any():
            raise SkippedLine("no target token (the assistant turns render empty)")
        return Example(ids, mask)

    def _unmarked_mask(self, encoding, text: str, messages: list[dict], count: int) -> np.ndarray:
        import numpy as np

        mask = np.zeros(count, dtype=np.uint8)
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                cursor = max(cursor, self._prompt_end(text, messages[:i]))
            start, end = _locate(text, message["content"], cursor)
            if start is None:
                if message["role"] == "assistant":
                    raise SkippedLine(
                        f"messages[{i}]: the chat template does not render this assistant turn's content as "
                        "it is; targets cannot be found without {% generation %} marks in the template"
                    )
                continue  # a system or user message the template leaves out or rewrites
            cursor = end
            if message["role"] != "assistant" or start == end:
                continue
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None or last is None:
                raise SkippedLine(f"messages[{i}]: its content maps to no token of the rendered text")
            mask[first : last + 1] = 1
            for j in range(last + 1, count):  # through the end-of-turn token, spaces before it included
                if encoding.ids[j] in self.special_ids:
                    mask[last + 1 : j + 1] = 1
                    break
                begin, stop = encoding.offsets[j]
                if text[begin:stop].strip():
                    break
        return mask

    def _prompt_end(self, text: str, before: list[dict]) -> int:
        """Where an assistant turn's text can start: after the conversation before it rendered with the
        generation prompt (the role header: a reply "a" or "assist" is not found inside
        "<|im_start|>assistant"), when `text` starts with that rendering; else 0 (the caller's cursor,
        after the previous message, stands)."""
        try:
            prompt, _ = self.render(before, add_generation_prompt=True)
        except SkippedLine:  # e.g. a template that refuses a conversation not ending as it expects
            return 0
        return len(prompt) if text.startswith(prompt) else 0


def _locate(text: str, content: str, cursor: int) -> tuple[int | None, int]:
    """(start, end) of `content` in `text` at or after `cursor`: verbatim, else stripped."""
    for wanted in (content, content.strip()):
        at = text.find(wanted, cursor)
        if at >= 0:
            return at, at + len(wanted)
    return None, cursor


def assistant_mask(encoding, spans: list[tuple[int, int]], count: int) -> np.ndarray:
    """1 on the tokens of each generation span, exactly as transformers' `apply_chat_template(...,
    return_assistant_tokens_mask=True)` (tokenization_utils_base.py, 5.23.0) computes `assistant_masks`."""
    import numpy as np

    mask = np.zeros(count, dtype=np.uint8)
    for start_char, end_char in spans:
        start = encoding.char_to_token(start_char)
        end = encoding.char_to_token(end_char - 1)
        if start is None:
            break
        mask[start : end + 1 if end else count] = 1
    return mask


# --- files -------------------------------------------------------------------------------------------


@dataclass
class ChatCounts:
    lines: int = 0
    examples: int = 0
    too_long: int = 0  # dropped, never cut
    skipped: Counter = field(default_factory=Counter)  # reason -> lines
    first_skipped: list[str] = field(default_factory=list)  # "line N: reason", the first FIRST_SKIPPED

    def skip(self, number: int, reason: str) -> None:
        # Counted by kind (the reason up to a first colon names it: "messages[2].role", "not JSON").
        self.skipped[reason.split(":")[0] if reason.startswith("messages[") else reason] += 1
        if len(self.first_skipped) < FIRST_SKIPPED:
            self.first_skipped.append(f"line {number}: {reason}")

    @property
    def skipped_lines(self) -> int:
        return sum(self.skipped.values())


def read_examples(
    stream, chat: ChatTokenizer, seq_len: int, counts: ChatCounts
) -> Iterator[tuple[int, bytes, Example]]:
    """(line number, the line's bytes, its example) of every usable conversation in a binary JSONL
    stream, each at most `seq_len` tokens; everything else is counted in `counts`."""
    number = 0
    while raw := stream.readline(MAX_RECORD_BYTES + 1):  # one line in memory, at most the bound
        number += 1
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            size = len(raw)
            del raw
            while (rest := stream.readline(READ_BYTES)) and not rest.endswith(b"\n"):
                size += len(rest)
            size += len(rest)  # the line's last piece, with its line break
            counts.lines += 1
            counts.skip(
                number, f"a line of {size:,} bytes, over the {MAX_RECORD_BYTES:,}-byte bound of one record"
            )
            continue
        if not raw.strip():
            continue
        counts.lines += 1
        try:
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a byte-order mark opens some exports
                raw = raw[3:]
            example = chat.encode(conversation(raw), max_tokens=seq_len)
        except SkippedLine as exc:
            counts.skip(number, str(exc))
            continue
        except TooLong:
            counts.too_long += 1
            continue
        if example.ids.size > seq_len:
            counts.too_long += 1
            continue
        counts.examples += 1
        yield number, raw, example
