"""What generation starts from and where the reply ends, for a plain prompt or a chat.

A plain prompt is its text's token ids; the reply ends at the tokenizer's end-of-sequence id. A chat (a list
of {"role", "content"} messages) is rendered with the model's chat template, or one given as a Jinja string,
with the generation prompt that opens the assistant's turn -- the text Hugging Face's
`apply_chat_template(..., add_generation_prompt=True)` gives. Its reply also ends where the template closes an
assistant turn (ChatTemplate.end_of_turn: `<|im_end|>` in ChatML, `<|eot_id|>` in Llama 3): an Instruct
model says it is done there, and its EOS may be another token. That text, tokenised, is one stop id when it
is one token, else a stop sequence the generated ids must end with. The stop is never part of the reply.

Torch-free and framework-free: every backend's generation (edgetrain.models.generate, and MLX's through it)
builds its prompt here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgetrain.data.chat_template import ChatTemplateError, Message, chat_template_for, check_messages
from edgetrain.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class GenerationPrompt:
    """The token ids to continue, and what ends the reply: any of `stop_ids` (one token each), or the
    generated ids ending with one of `stop_sequences` (an end of turn the tokenizer spells in several)."""
    ids: list[int]
    stop_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def reply(self, produced: Sequence[int]) -> list[int]:
        """`produced` without the stop it ended at."""
        produced = list(produced)
        if produced and produced[-1] in self.stop_ids:
            return produced[:-1]
        for sequence in self.stop_sequences:
            if ends_with(produced, sequence):
                return produced[:-len(sequence)]
        return produced


def ends_with(ids: Sequence[int], sequence: Sequence[int]) -> bool:
    """Whether `ids` ends with the (non-empty) `sequence`."""
    return 0 < len(sequence) <= len(ids) and list(ids[-len(sequence):]) == list(sequence)


def _eos(tokenizer: Tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


def text_prompt(tokenizer: Tokenizer, text: str) -> GenerationPrompt:
    """`text`'s ids; the reply ends at the tokenizer's end-of-sequence id when it has one."""
    return GenerationPrompt(tokenizer.encode(text), _eos(tokenizer))


def chat_prompt(tokenizer: Tokenizer, messages: Sequence[Message],
                chat_template: str | None = None) -> GenerationPrompt:
    """The chat rendered for the assistant's reply and tokenised; the reply ends at EOS or at the template's
    end of turn. `chat_template` (a Jinja string) is used instead of the tokenizer's own; a chat with
    neither is a ChatTemplateError, a malformed one a ChatMessageError."""
    messages = check_messages(messages, "the prompt")
    template = chat_template_for(tokenizer, chat_template)
    if template is None:
        raise ChatTemplateError(f"a chat prompt needs a chat template, and the model's tokenizer "
                                f"({type(tokenizer).__name__}) has none: use a model whose tokenizer_config.json "
                                "or GGUF carries one, or pass chat_template= (a Jinja string)")
    ids = tokenizer.encode(template.render(messages, add_generation_prompt=True))
    stop_ids, stop_sequences = _eos(tokenizer), ()
    ending = template.end_of_turn()
    if ending is not None:
        ending_ids = tuple(tokenizer.encode(ending))
        if len(ending_ids) == 1:
            stop_ids = tuple(dict.fromkeys(stop_ids + ending_ids))  # the end of turn is often EOS itself
        else:
            stop_sequences = (ending_ids,)
    return GenerationPrompt(ids, stop_ids, stop_sequences)


def generation_prompt(tokenizer: Tokenizer, prompt: str | Sequence[Message],
                      chat_template: str | None = None) -> GenerationPrompt:
    """A plain prompt (a string) or a chat (a list of messages), see text_prompt and chat_prompt."""
    if isinstance(prompt, str):
        if chat_template is not None:
            # Ignoring it would hide a mistake: the caller meant a chat and passed its text.
            raise ChatTemplateError("chat_template= applies to a chat prompt (a list of messages), and the "
                                    "prompt is a plain string")
        return text_prompt(tokenizer, prompt)
    return chat_prompt(tokenizer, prompt, chat_template)
