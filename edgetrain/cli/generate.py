"""Write text with a model (and its LoRA adapter): the continuation of --prompt, or the assistant's reply to a
chat, greedy or sampled.

    edgetrain generate --model smollm2-135m --prompt "The capital of France is"
    edgetrain generate --model smollm2-135m --adapter adapter.safetensors --prompt "..." --temperature 0.7
    edgetrain generate --backend mlx --model model.gguf --prompt "..."   # MLX, 4/8-bit weights kept packed
    edgetrain generate --model smollm2-135m --chat --prompt "What is the capital of France?"
    edgetrain generate --model smollm2-135m --messages chats.jsonl      # one JSON line out per conversation

Tokens come from the model's own tokenizer; a key/value cache keeps each new token's cost flat. A chat is
rendered with the model's chat template (or --chat-template) and its reply stops at the end of the
assistant's turn (edgetrain.data.chat_prompt). The text goes to stdout.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from edgetrain.cli.model_args import add_model_flags, load_model_and_adapter, text_functions
from edgetrain.utils.progress import begin_stage, note_stage


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_model_flags(parser)
    parser.add_argument("--prompt", default=None,
                        help="the text to continue; with --chat, the user's message (this or --messages)")
    parser.add_argument("--chat", action="store_true",
                        help="--prompt is one user message: rendered with the model's chat template, and the "
                             "reply stops at the end of the assistant's turn")
    parser.add_argument("--messages", default=None, metavar="FILE.jsonl",
                        help="conversations, one {\"messages\": [...]} object a line (this or --prompt): each is "
                             "printed as one JSON line, the model's reply appended as an assistant message")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                        help="a Jinja chat template (a file, or the template itself) for a model whose tokenizer "
                             "has none; with --chat or --messages")
    parser.add_argument("--max-tokens", type=int, default=64, help="at most this many new tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample only from this much probability mass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    from edgetrain.registry import EdgetrainError

    if (args.prompt is None) == (args.messages is None):
        raise EdgetrainError("generate needs exactly one of --prompt (text, or with --chat a user message) and "
                             "--messages FILE.jsonl (conversations)")
    if args.chat and args.messages is not None:
        raise EdgetrainError("--chat goes with --prompt; --messages FILE.jsonl holds chats already")
    if args.chat_template is not None and not (args.chat or args.messages is not None):
        raise EdgetrainError("--chat-template applies to chats: add --chat, or give --messages FILE.jsonl")


def read_chat_template(value: str) -> str:
    """--chat-template's Jinja text: the value itself when it reads as a template ({{ or {% in it), else the
    file it names."""
    from edgetrain.data.chat_template import ChatTemplateError
    from edgetrain.files.user import require_regular_file

    if "{{" in value or "{%" in value:
        return value
    path = require_regular_file(value, ChatTemplateError, "the --chat-template file (and it is no Jinja template)")
    return Path(path).read_text(encoding="utf-8")


def _reply_lines(text: Any, model: Any, chats: list[dict[str, Any]], args: argparse.Namespace,
                 template: str | None) -> None:
    for number, chat in enumerate(chats, 1):
        note_stage(f"conversation {number} of {len(chats)}")
        reply = text.generate(model, chat["messages"], args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, chat_template=template)
        answered = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": reply}]}
        print(json.dumps(answered, ensure_ascii=False), flush=True)  # a line as soon as it is ready


def main(args: argparse.Namespace) -> int:
    _check_flags(args)
    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    chats = None
    if args.messages is not None:
        from edgetrain.data.jsonl import read_chats

        chats = read_chats(args.messages)  # every line checked before the model is loaded
    text = text_functions(args)  # the backend's own generation (torch or MLX, both with a key/value cache)
    model = load_model_and_adapter(args)
    if chats is not None:
        begin_stage(f"answering {len(chats)} conversation(s), up to {args.max_tokens} tokens each")
        _reply_lines(text, model, chats, args, template)
        return 0
    begin_stage(f"generating up to {args.max_tokens} tokens")
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    print(text.generate(model, prompt, args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, chat_template=template))
    return 0
