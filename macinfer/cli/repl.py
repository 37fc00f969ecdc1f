"""`macinfer chat`: a terminal conversation with line editing, history and commands."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

HELP = """commands:
  /help            this list
  /reset           forget the conversation (keeps the system prompt)
  /system TEXT     set the system prompt and reset
  /exit, /quit     leave (or Ctrl-D)
Earlier turns are dropped, oldest first, when the conversation outgrows the context."""


def _enable_line_editing() -> str | None:
    """readline: arrow keys, Ctrl-R and a history file across sessions (where available)."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline
        return None
    path = os.path.join(os.path.expanduser("~"), ".cache", "macinfer", "chat_history")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path):
            readline.read_history_file(path)
        readline.set_history_length(1000)
    except OSError:
        return None
    return path


class ChatREPL:
    def __init__(self, engine: Any, params: Any, system: str | None, stream: Callable[[list[int]], str]):
        self.engine = engine
        self.params = params
        self.system = system
        self.stream = stream
        self.history: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def fit(self) -> list[int] | None:
        """Prompt ids for the conversation, dropping the oldest turns until the prompt
        and max_tokens fit the context; None if even the last message cannot."""
        room = self.engine.max_model_len - (self.params.max_tokens or 1)
        dropped = 0
        while True:
            ids = self.engine.tokenizer.encode_chat(self.messages())
            if len(ids) <= room:
                if dropped:
                    click.echo(f"[dropped {dropped} earlier messages to fit the {self.engine.max_model_len}-token context]",
                               err=True)
                return ids
            if len(self.history) <= 1:
                return None
            # Drop the oldest exchange: a user message and the reply after it.
            cut = 2 if len(self.history) > 2 and self.history[1]["role"] == "assistant" else 1
            del self.history[:cut]
            dropped += cut

    def handle_command(self, line: str) -> bool:
        """Run a /command; False means quit."""
        cmd, _, arg = line.partition(" ")
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/help":
            click.echo(HELP)
        elif cmd == "/reset":
            self.history.clear()
            click.echo("[conversation cleared]")
        elif cmd == "/system":
            self.system = arg.strip() or None
            self.history.clear()
            click.echo("[system prompt set; conversation cleared]")
        else:
            click.echo(f"unknown command {cmd}; /help lists them")
        return True

    def run(self) -> None:
        history_file = _enable_line_editing()
        click.echo("type a message; /help for commands, Ctrl-D to quit", err=True)
        try:
            while True:
                try:
                    line = input(">>> ")
                except (EOFError, KeyboardInterrupt):
                    click.echo()
                    return
                if not line.strip():
                    continue
                if line.startswith("/"):
                    if not self.handle_command(line.strip()):
                        return
                    continue
                self.history.append({"role": "user", "content": line})
                try:
                    ids = self.fit()
                except ValueError as e:  # the template refused the conversation
                    click.echo(f"error: {e}", err=True)
                    self.history.pop()
                    continue
                if ids is None:
                    click.echo("error: that message alone is longer than the context; shorten it", err=True)
                    self.history.pop()
                    continue
                try:
                    text = self.stream(ids)
                except click.ClickException as e:
                    click.echo(f"error: {e.message}", err=True)
                    self.history.pop()
                    continue
                self.history.append({"role": "assistant", "content": text})
        finally:
            if history_file:
                import readline

                try:
                    readline.write_history_file(history_file)
                except OSError:
                    pass
