"""A model's chat template, rendered the way Hugging Face renders it, and which characters of the rendered
text are the assistant's: the part of a chat a fine-tune learns.

The template is the tokenizer's `chat_template` (a checkpoint's tokenizer_config.json or chat_template.jinja,
a GGUF's `tokenizer.chat_template`) or a Jinja string given directly. Templates come from model hubs and are
untrusted code, so they run in jinja2's immutable sandbox with what Hugging Face's templates expect:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token` (when the tokenizer has them), `raise_exception`,
`strftime_now`, `namespace`, a `tojson` filter that does not escape HTML, `trim_blocks`/`lstrip_blocks`, loop
controls, and `{% generation %}` blocks (rendered as their content; not used to find the assistant's text).

The assistant's text is found by rendering incrementally, the usual way of masking chat templates: for
assistant message i, the conversation up to message i - 1 with the generation prompt is the prompt; the
message's content is looked up right after it (verbatim, else stripped of surrounding whitespace, since some
templates `trim` it) in the conversation up to message i; the span runs from there through the end of the
turn that follows the content, trailing whitespace excluded -- `<|im_end|>` in ChatML, `<|eot_id|>` in
Llama 3 -- so the model also learns to stop. A template whose renderings are not prefixes of one another
(one that rewrites earlier turns once later ones exist) is refused by name: its assistant text cannot be
told apart this way.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

from edgetrain.registry import EdgetrainError

Message = Mapping[str, Any]
_MIN_JINJA = (3, 1, 6)  # older jinja2 releases have known sandbox escapes (the bound transformers enforces)


class ChatTemplateError(EdgetrainError, ValueError):
    """A chat template that cannot be compiled or rendered, or whose assistant text cannot be located."""


class ChatMessageError(EdgetrainError, ValueError):
    """A conversation that is not a non-empty list of {"role": str, "content": str} messages."""


# The assistant's content in the conversation end_of_turn renders: plain letters, so that no template's
# escaping or trimming changes it, and unlike anything a template writes around a message.
_PROBE_CONTENT = "EdgetrainEndOfTurnProbe"
_PROBE_CHAT = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE_CONTENT})


def check_messages(messages: object, where: str = "the chat") -> list[dict[str, str]]:
    """`messages` as a list of dicts, after checking that it is a non-empty list of messages whose "role"
    and "content" are strings; a ChatMessageError names `where` and the message otherwise. Any role is
    accepted: which roles a model knows is its chat template's business."""
    if not isinstance(messages, (list, tuple)):
        raise ChatMessageError(f"{where}: a chat must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ChatMessageError(f"{where}: the chat has no messages")
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatMessageError(f"{where}: message {number} must be a dict with \"role\" and \"content\", "
                                   f"got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ChatMessageError(f"{where}: message {number} needs a string {key!r}, "
                                       f"got {type(message.get(key)).__name__}")
    return [dict(message) for message in messages]


def _environment() -> Any:
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise EdgetrainError("rendering a chat template needs the 'jinja2' package: pip install jinja2") from None
    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < _MIN_JINJA:
        raise EdgetrainError(f"chat templates need jinja2 >= 3.1.6 (older releases have sandbox escapes), "
                             f"found {jinja2.__version__}: pip install -U jinja2")

    class GenerationBlocks(jinja2.ext.Extension):
        # HF templates may mark assistant text with {% generation %}...{% endgeneration %}; without this
        # extension such a template would not even compile. The block renders as its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes <, > and & for HTML, which would change the text a model is trained on.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


class ChatTemplate:
    """A compiled chat template. `bos_token`/`eos_token` are the special tokens' text, passed to the
    template as HF passes them (left undefined when None)."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("a chat template must be a non-empty Jinja string")
        environment = _environment()  # first: it names a missing jinja2
        import jinja2

        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc.message} (template line "
                                    f"{exc.lineno})") from None
        self.source = source
        self._specials = {name: value for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
                          if value is not None}

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as the model sees it; a template error (e.g. its own raise_exception on roles
        that do not alternate) is a ChatTemplateError."""
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **self._specials)
        except Exception as exc:  # a template is code: besides jinja2's own errors it can raise TypeError & co.
            raise ChatTemplateError(f"the chat template failed: {exc}") from None

    def _prompt_end(self, messages: Sequence[Message], index: int, upto: str) -> int:
        """Where the text before assistant message `index` ends in `upto` (the rendering through it)."""
        for add_generation_prompt in (True, False):
            try:
                prompt = self.render(messages[:index], add_generation_prompt=add_generation_prompt)
            except ChatTemplateError:
                if index == 0:  # some templates cannot render an empty conversation; nothing comes before
                    return 0
                raise
            if upto.startswith(prompt):
                return len(prompt)
        if index == 0:
            return 0
        raise ChatTemplateError(f"message {index}: the chat template renders the conversation before it "
                                "differently once it is there, so its assistant text cannot be located")

    def assistant_spans(self, messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and, for each assistant message, the [start, end) character span that
        carries the loss: its content and the end-of-turn text after it (see the module docstring)."""
        text = self.render(messages)
        spans: list[tuple[int, int]] = []
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            upto = self.render(messages[:index + 1])
            if not text.startswith(upto):
                raise ChatTemplateError(f"message {index}: the chat template renders earlier turns differently "
                                        "once later ones exist, so assistant text cannot be located")
            start = self._prompt_end(messages, index, upto)
            content = str(message.get("content", ""))
            for candidate in (content, content.strip()):
                found = upto.find(candidate, start)
                if found >= 0:
                    break
            else:
                raise ChatTemplateError(f"message {index}: the chat template does not render the assistant's "
                                        "content verbatim, so it cannot be located")
            end = found + len(candidate)
            end += len(upto[end:].rstrip())  # the rest of the turn: its end-of-turn token(s)
            spans.append((found, end))
        return text, spans

    def end_of_turn(self) -> str | None:
        """The text that closes an assistant turn (`<|im_end|>` in ChatML, `<|eot_id|>` in Llama 3), what a
        reply generated with this template stops at: the turn's rest after the assistant's content (as
        assistant_spans finds it) in a probe conversation, stripped of whitespace; None when the template
        writes nothing there."""
        text, spans = self.assistant_spans(_PROBE_CHAT)
        start, end = spans[0]
        ending = text[start + len(_PROBE_CONTENT):end].strip()
        return ending or None


def special_token_text(tokenizer: object, name: str) -> str | None:
    """The text of the tokenizer's `name` ("bos", "eos") token: its `<name>_token` string when it keeps one
    (HFTokenizer), else its `<name>_token_id` decoded (GGUFTokenizer); None when it has neither."""
    text = getattr(tokenizer, f"{name}_token", None)
    if isinstance(text, str):
        return text
    token_id = getattr(tokenizer, f"{name}_token_id", None)
    return tokenizer.decode([token_id]) if isinstance(token_id, int) else None  # type: ignore[attr-defined]


def chat_template_for(tokenizer: object, template: str | None = None) -> ChatTemplate | None:
    """`template` (a Jinja string), else the tokenizer's own `chat_template`, compiled with the tokenizer's
    BOS/EOS text; None when there is neither."""
    source = template if template is not None else getattr(tokenizer, "chat_template", None)
    if source is None:
        return None
    return ChatTemplate(source, bos_token=special_token_text(tokenizer, "bos"),
                        eos_token=special_token_text(tokenizer, "eos"))
