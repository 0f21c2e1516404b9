"""One --chat session's engine side, behind the REPL.

Owns: the chat's state and conversation (``Chat``: a turn, clear, load, save, the
figures /stats shows), the refusal of a turn that does not fit --ctx-size, and the loop
that reads entries from the console, runs turns and commands, and saves the state at the
end (``run_chat``). Does not own: reading and editing lines or the commands' texts
(``repl``), opening the model (``runner.Run``) or printing tokens (the front end's
printer).
"""

from __future__ import annotations

import dataclasses

from ..engine.generate import GenSettings, Hooks, Prompt, generate
from ..engine.settings import room_problem
from ..errors import UsageError
from .runner import Run, _load_state


class TurnTooLong(UsageError):
    """A chat turn that, with its reply, does not fit --ctx-size (the chat goes on)."""


class Chat:
    """One chat's engine side: the state, the conversation it holds
    (``chat.Conversation``), the settings of the next turn and the last reply. What the
    user types and the commands are ``repl``'s. A fresh conversation (at start, after
    ``clear``) opens with ``system``; one continued from a saved state does not: the
    state already has its own start."""

    def __init__(self, run: Run, settings: GenSettings, *, load_state=None, system=None,
                 template_kwargs=None, warn=None):
        self.run = run
        self.tokenizer = run.session.tokenizer
        if self.tokenizer is None:
            raise UsageError("--chat needs the model's tokenizer (tiktoken.model)")
        self.settings = settings
        why = self._system_problem(system)
        if why:
            raise UsageError(f"--system: {why}")
        self.system = system
        self.template_kwargs = template_kwargs
        self.warn = warn
        self.template = run.chat(warn).template
        self.last = None                        # the last reply's GenResult
        self.images = None                      # the run's ``images.Images``, at /image
        self.pending: list = []                 # images attached to the next message
        self.loaded = None                      # the state file this conversation continues
        if load_state:
            self.load(load_state)
            if system and warn is not None:
                warn("--system opens the next fresh conversation (/clear), not the loaded "
                     "state's")
        else:
            self.clear()

    def _conversation(self, system):
        from ..text.chat import Conversation
        return Conversation(self.tokenizer, self.template, self.template_kwargs, system)

    def clear(self) -> None:
        """A new conversation in a new state."""
        self.state = self.run.session.new_state()
        self.convo = self._conversation(self.system)
        self.last = self.loaded = None
        self.held, self.pending = [], []        # images in the conversation, attached

    def load(self, path) -> None:
        """Continue from the state saved at ``path`` (FormatError: the chat as it was);
        the last reply and the turns counted are this conversation's from then on."""
        self.state = _load_state(self.run, path)
        self.convo = self._conversation(None)
        self.last, self.loaded = None, str(path)
        self.held, self.pending = [], []

    def attach(self, path):
        """``/image PATH``: the image (read and encoded now: FormatError naming the file)
        opens the next message (formats/model/vision.md §8.1)."""
        if self.images is None:
            from .images import Images
            self.images = Images(self.run.session, "/image")
        image = self.images.load(path)
        self.pending.append(image)
        return image

    def save(self, path) -> None:
        self.state.save(path, self.run.session.weights_identity)

    def _system_problem(self, text) -> str | None:
        """Why a system message cannot fit the context, from its size (before it is
        tokenized), or None."""
        context = self.run.context
        size = len((text or "").encode("utf-8", "surrogatepass"))
        if size > (context - 1) * self.tokenizer.longest_rank_bytes:
            return (f"the system message is {size:,} bytes, more than the context of "
                    f"{context:,} tokens can hold")
        return None

    def set_system(self, text) -> bool:
        """``text`` opens the next fresh conversation, and this one when nothing is in its
        state yet (then True). TurnTooLong, the chat unchanged, for a text too long for
        the context (by its size, before it is tokenized)."""
        why = self._system_problem(text)
        if why:
            raise TurnTooLong(why)
        self.system = text
        if self.state.pos == 0 and not self.convo.fed:
            self.convo = self._conversation(text)
            return True
        return False

    def change(self, **values) -> None:
        """Settings of the next turns (checked by the caller: ``settings`` rules)."""
        self.settings = dataclasses.replace(self.settings, **values)

    def turn(self, text: str, on_token=None, interrupted=None):
        """One user message and the model's reply (``generate``: ``interrupted`` cuts it
        short at a token, the state as if the reply had ended there). UsageError, the
        conversation as it was, when the turn and its reply do not fit --ctx-size."""
        context = self.run.context
        limit = self.run.opts.context_limit
        named = f"--ctx-size {limit}: " if limit is not None else ""
        room = context - self.state.pos - 1            # a reply of one token at least
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > room * self.tokenizer.longest_rank_bytes:     # before tokenizing it
            raise TurnTooLong(f"{named}the message is {size:,} bytes, more than the "
                              f"{room:,} tokens left in the context of {context:,} can hold")
        before = (list(self.convo.messages), self.convo.fed)
        ids, fresh = self.convo.add_user(text, limit=context,   # stops past the context
                                         images=list(map(self._markup, self.pending)))
        rows = []
        if self.held or self.pending:     # a fresh rendering holds every image again
            ids, rows = self.images.expand(ids, (self.held if fresh else []) + self.pending,
                                           "the rendered message")
        held = 0 if fresh else self.state.pos
        try:
            self.run.check_fits(held + len(ids), self.settings.gen)     # names --ctx-size
            why = room_problem(held, len(ids), -1, context)
            if why:
                raise UsageError(named + why.replace("prompt", "message", 1)
                                 .replace("the model's context", "the context"))
        except UsageError as e:
            self.convo.messages, self.convo.fed = before
            raise TurnTooLong(e.message) from None
        if fresh:
            self.state = self.run.session.new_state()
        res = generate(self.run.session.forward, self.state, Prompt(ids, tuple(rows)),
                       self.run.chat_settings(self.settings, self.warn),
                       tokenizer=self.tokenizer, drafting=self.run.drafting,
                       hooks=Hooks(on_token=on_token, interrupted=interrupted))
        self.held, self.pending = self.held + self.pending, []
        self.convo.add_reply(self.run.reply_message(res.generated_ids, res.stop_strings))
        self.last = res
        return res

    def _markup(self, image) -> str:
        from ..media.markup import markup
        return markup(image.size)

    def stats(self) -> dict:
        """Tokens in the state, the model's context, user turns since the conversation
        began (or its state was loaded), the last GenResult, the state file it continues."""
        return {"tokens": self.state.pos, "context": self.run.context,
                "turns": sum(m["role"] == "user" for m in self.convo.messages),
                "last": self.last, "loaded": self.loaded}


def run_chat(run: Run, settings: GenSettings, *, load_state, save_state, emit_factory,
             console, warn=None, template_kwargs=None, system=None, images=()) -> None:
    """A multi-turn chat in the model's chat template: ``console`` (``repl.Console``)
    gives each entry; a message is a turn (``Chat.turn``) whose reply
    ``emit_factory()``'s printer writes, a command is ``repl.perform``'s. End of input or
    /exit ends the chat; the state is saved then if asked (not when it holds image rows:
    formats/model/vision.md §8.3). ``images``: files the first message opens with (--image)."""
    from . import repl

    chat = Chat(run, settings, load_state=load_state, system=system,
                template_kwargs=template_kwargs, warn=warn)
    for path in images:
        chat.attach(path)
    console.say(repl.banner(run.opts.model, load_state, chat.state.pos))
    try:
        while True:
            entry = console.read()
            if entry is None:
                break
            if isinstance(entry, repl.Command):
                if not repl.perform(entry, chat, console):
                    break
                continue
            printer = emit_factory()
            try:
                with console.reply() as interrupted:
                    res = chat.turn(entry, printer, interrupted)
            except TurnTooLong as e:            # the turn does not fit: say so, chat on
                console.say(f"error: {e.one_line()} (not sent)")
                continue
            printer.finish()
            if res.stop_reason == "interrupted":
                console.say(f"(reply stopped after {len(res.generated_ids)} tokens)")
    finally:                          # at any exit, the conversation so far is kept
        if save_state and chat.state.media:
            console.say(f"state not saved to {save_state}: it holds image rows, which a "
                        "state file cannot name")
        elif save_state:
            chat.save(save_state)
            console.say(f"state saved to {save_state} ({chat.state.pos:,} tokens): "
                        f"--load-state {save_state} continues it")
