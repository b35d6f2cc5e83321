"""A terminal chat that personalises its model between turns: each exchange goes into the user's store, and
while the user is reading or typing the model trains on what was said, in the background.

    python samples/chat_personalise.py                           # SmolLM2-135M-Instruct (the GGUF, 93 MB)
    python samples/chat_personalise.py --model tiny --max-tokens 8 --no-guard   # a quick look, a random preset

Type a message and press Enter; `/status` shows the store (examples, versions, what is served), `/quit`
(or Ctrl-D) checkpoints and leaves. Everything lives in `--store`: kill the program at any moment -- in the
middle of a reply or of a training step -- and start it again: every exchange whose reply was printed is
still there (it was committed before the reply was shown), training resumes from its last checkpoint, and
the chat answers with the last promoted adapter.

How it uses edgetrain.Personaliser: `Policy(require_idle=True)` trains only while the app says it is idle,
and the chat says so while it waits at the prompt; when a line arrives it says not idle, so training pauses
within one step and the reply gets the processor. A new version is only served once the gate promoted it:
it beat the previous one on held-out exchanges, and the forgetting guard found it still answers general
prompts as the base model did (its retain set, made by the base model on the first run). The sample keeps
the Personaliser's defaults: with the guard on, a quarter of each window's batches replay that set (on
SmolLM2 a window of plain-text notes moved its answers to general prompts 20-30% without it, and the guard
rejected every window: docs/personalise.md has the figures). The chat then reloads the model with a
promoted version. Replies use the model's own chat
template (edgetrain.models.generate takes the conversation) and end at its end of turn. `--no-guard` turns
the guard and replay off: a random preset such as `tiny` knows nothing to keep.
"""
from __future__ import annotations

import argparse
import queue
import sys
from pathlib import Path
from typing import Any

from edgetrain.data.chat_template import chat_template_for
from edgetrain.models.generate import generate
from edgetrain.backends.load_options import LoadOptions, add_load_flags
from edgetrain.personalise import Personaliser, Policy


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=str(Path.home() / ".edgetrain-chat"),
                        help="the user's store: examples, adapters, checkpoints (default ~/.edgetrain-chat)")
    parser.add_argument("--model", default="smollm2-135m", help="base model (a store keeps the one it was made with)")
    parser.add_argument("--method", default="mesp", help="training method (default mesp)")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest reply, in tokens")
    parser.add_argument("--window-steps", type=int, default=10, help="training steps between promotion gates")
    parser.add_argument("--seq", type=int, default=128, help="training sequence length")
    parser.add_argument("--no-guard", action="store_true",
                        help="no forgetting guard (for a random preset, whose own answers are noise)")
    add_load_flags(parser, dtype_default=None)  # the base is kept packed unless --dequantize
    return parser


class Chat:
    """The conversation: prompts in the model's own chat format, the served model reloaded when the gate
    promotes a new version."""

    def __init__(self, personaliser: Personaliser, max_tokens: int) -> None:
        self.personaliser, self.max_tokens = personaliser, max_tokens
        self.model: Any = None
        self.serving: Any = None
        self.template = None

    def refresh(self) -> None:
        served = self.personaliser.status()["served"]
        if self.model is None or served != self.serving:
            print(f"(loading the model with {'the base' if served == 'base' else f'version {served}'})", flush=True)
            self.model = self.personaliser.model_for_inference()
            tokenizer = getattr(self.model, "tokenizer", None)  # presets have none (byte tokens)
            self.template = chat_template_for(tokenizer) if tokenizer is not None else None
            self.serving = served

    def reply(self, line: str) -> str:
        self.refresh()
        if self.template is not None:  # rendered with the model's chat template, stopped at its end of turn
            return generate(self.model, [{"role": "user", "content": line}], self.max_tokens).strip()
        return generate(self.model, f"User: {line}\nAssistant:", self.max_tokens).strip()

    def example(self, line: str, answer: str) -> Any:
        """What the store keeps of one exchange: chat turns when the model has a chat format, else text."""
        if self.template is not None:
            return [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]
        return f"User: {line}\nAssistant: {answer}\n"


def _news(events: "queue.Queue[dict]") -> list[str]:
    """One line per promotion or rejection since the last prompt."""
    lines = []
    while not events.empty():
        event = events.get_nowait()
        if event["event"] == "promoted":
            lines.append(f"(a new version, {event.get('version')}, beat the last on held-out exchanges)")
        elif event["event"] == "rejected" and "forgetting" in event.get("reason", ""):
            lines.append(f"(the last training window forgot what the model knew: its answers to general prompts "
                         f"got {100 * event['retain_worsened']:.1f}% less likely; kept the current version. "
                         f"To help: {event['advice']})")
        elif event["event"] == "rejected":
            lines.append("(the last training window did not improve held-out exchanges: kept the current version)")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    events: "queue.Queue[dict]" = queue.Queue()
    personaliser = Personaliser(args.store, model=args.model, method=args.method, window_steps=args.window_steps,
                                seq_len=args.seq, checkpoint_every=2, policy=Policy(require_idle=True),
                                on_event=events.put, load=LoadOptions.asked_for(args),
                                **({"retain_margin": None} if args.no_guard else {}))
    chat = Chat(personaliser, args.max_tokens)
    chat.refresh()
    status = personaliser.status()
    print(f"store {status['store']}: {status['examples']} exchanges kept, serving "
          f"{'the base model' if status['served'] == 'base' else 'version ' + str(status['served'])}. "
          "Type /status or /quit.", flush=True)
    personaliser.start()
    try:
        while True:
            for line in _news(events):
                print(line, flush=True)
            personaliser.set_idle(True)
            try:
                line = input("you> ").strip()
            except EOFError:
                break
            personaliser.set_idle(False)
            if not line:
                continue
            if line == "/quit":
                break
            if line == "/status":
                status = personaliser.status()
                print(f"examples {status['examples']} (held out {status['held_out']}), served {status['served']}, "
                      f"versions {[v['version'] for v in status['versions']]}, running {status['running']}",
                      flush=True)
                continue
            answer = chat.reply(line)
            personaliser.add(chat.example(line, answer))  # durable before the user sees the reply
            print(f"bot> {answer}", flush=True)
    finally:
        personaliser.stop()
        personaliser.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
