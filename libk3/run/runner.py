"""What one k3-run invocation does, behind the click front end.

Owns: resolving budgets (presets, flags in argv order, auto) before any long work,
admission against available memory, opening the session, trace recording, and one
prompt's run (a batch file: ``batch_run``; a chat: ``chat_session``). Does not own:
option parsing or printing.
"""

from __future__ import annotations

import contextlib
import functools
import dataclasses

import numpy as np

from ..engine.defaults import IO_THREADS, PREFILL_CHUNK, PREFIX_CACHE_BYTES
from ..engine.generate import Abandoned, GenSettings, Hooks, Prompt, Reuse, generate
from ..engine.session import Reads, open_session
from ..engine.settings import UNTIL_END, room_problem, token_ids_problem
from ..engine.stops import returned_text
from ..errors import BudgetError, FormatError, UsageError
from ..model.state import State
from ..policies.registry import DEFAULT_POLICY
from ..text.chat_template import DEFAULT_LIMITS, RenderLimits
from ..text.prompts import Prompts
from ..trace.format import PHASE_DECODE, PHASE_PREDICTED, PHASE_PREFILL, RECORD_DTYPE
from .drafting import draft_cap, start_drafting
from .report import run_report, startup_seconds


@dataclasses.dataclass
class RunOptions:
    model: str
    pack: str | None = None
    preset: str | None = None
    trunk_gb: float | None = None
    cache_gb: float | None = None
    budget_order: list = dataclasses.field(default_factory=list)
    resident: bool = False
    cache_policy: str = DEFAULT_POLICY
    io_threads: int = IO_THREADS
    prefetch_experts: int | None = None    # experts read ahead per layer (None: top_k)
    direct_io: bool = True
    trace_path: str | None = None
    memory_override: int | None = None
    beside_bytes: int = 0                  # held beside the model by the front end (a server's)
    vision: bool = False                   # images are read: the tower is held beside the model
    image_dir: str | None = None           # where a request's image paths may be read (--image-dir)
    verify_reads: str = "first"
    batch_width: int | str | None = None   # lockstep width (batch, serve): N, "auto"; None: 1
    progress: bool = True                  # progress on stderr (progress.bar); --quiet: none
    spec: int = 0                          # prompt-lookup proposals per pass, at most (--spec)
    draft: str | None = None               # a DSpark draft directory (--draft)
    draft_max: int | None = None           # proposals per pass, at most (None: its block)
    draft_dump: str | None = None          # --draft-dump FILE.npz
    warn: object = None                    # notes for the user (drafting turned off, ...)
    template_limits: RenderLimits = DEFAULT_LIMITS   # of each chat-template rendering
    prefix_cache: str | None = None        # a prefix cache directory, or "auto" (--prefix-cache)
    prefix_cache_bytes: int = PREFIX_CACHE_BYTES     # its budget on disk
    share_prefixes: bool = True            # a batch prefills a prefix its lines share once
    serve: bool = False                    # the run serves requests (--serve)
    load_state: str | None = None          # a state to resume (--load-state): checked first
    prefill_chunk: int | None = None       # prompt tokens per prefill pass (None: the rule's)
    context_limit: int | None = None       # --ctx-size: prompt + generated tokens, at most
    stripe_dirs: tuple = ()                # a striped pack's stripe directories (--stripe-dir)
    io_throttle_mbps: float | None = None  # each drive queue's read cap (--io-throttle-mbps)


def settings_from(gen, temperature, top_p, seed, stop_strings=(), stop_ids=(),
                  prefill_chunk=PREFILL_CHUNK, *, model=None, **sampling) -> GenSettings:
    """A run's settings from its options. ``sampling``: the sampler's other fields of
    ``GenSettings`` by name (top_k, min_p, the penalties, logit_bias); ``model``: the directory whose
    context (max_position_embeddings) a ``gen`` of -1 runs up to."""
    from ..config import context_length
    extra = {} if model is None else {"context": context_length(model)}
    return GenSettings(gen=gen, temperature=temperature, top_p=top_p, seed=seed,
                       stop_ids=tuple(stop_ids), stop_strings=tuple(stop_strings),
                       prefill_chunk=prefill_chunk, **sampling, **extra)


def resolve_run_budget(opts: RunOptions, ckpt, draft=None, stream: bool | None = None):
    """Budget from presets/flags (argv order; ``auto`` sets aside a fixed --batch-width's
    state and ``opts.beside_bytes``), refused before loading when it cannot work; then the
    batch width
    (``budget.batch_width``). A ``draft`` (its checked checkpoint) is counted beside the
    model: held whole, or with ``stream`` only what it holds when its matrices are read at
    each use; None: held whole when that fits, else streamed. Returns (budget or None
    when resident, width, reasons, whether the draft streams, (prefill chunk, expert
    cache bytes beside its activations or None when resident, why the chunk)): the chunk
    is ``opts.prefill_chunk``, else ``budget.prefill_chunk``'s rule."""
    from ..machine.memory import probe_memory
    from ..budget import (Budget, ModelSizes, admission_problems, batch_width, load_rules,
                          prefill_chunk, resolve_budget, sequence_bytes, vision_bytes,
                          with_beside, with_draft)

    if draft is not None and stream is None:
        try:
            return resolve_run_budget(opts, ckpt, draft, False)
        except BudgetError:
            return resolve_run_budget(opts, ckpt, draft, True)
    alone = ModelSizes.from_checkpoint(ckpt)     # without what the front end holds beside
    held_draft = 0
    if draft is not None:
        held_draft = draft.streamed_nbytes if stream else draft.nbytes
        alone = with_draft(alone, ckpt.config, held_draft, draft.cfg.num_hidden_layers
                           * draft.cfg.cache_width * 4, draft_cap(opts, draft.cfg))
    sizes = with_beside(alone, opts.beside_bytes + vision_bytes(ckpt.vision_config, opts.vision))
    mem = probe_memory(opts.memory_override)
    fixed = opts.batch_width if isinstance(opts.batch_width, int) else 1

    def plan(s):
        """(budget, admission problems) for sizes ``s``; BudgetError when none works."""
        b = resolve_budget(opts.preset, opts.trunk_gb, opts.cache_gb,
                           order=opts.budget_order or None, mem=mem, model_sizes=s, width=fixed)
        return b, admission_problems(b, s, mem)

    def tipped_by_beside() -> bool:
        """Whether the same run without the front end's memory would be admitted (the
        refusal then names it)."""
        if not opts.beside_bytes:
            return False
        try:
            return not plan(alone)[1]
        except BudgetError:
            return False
    beside = (f"the server holds {opts.beside_bytes / 1e9:.2f} GB beside the model "
              "(--reuse-gb and its request reader)")
    budget = None
    if not opts.resident:
        try:
            budget, problems = plan(sizes)
        except BudgetError as e:
            if not tipped_by_beside():
                raise
            raise BudgetError(e.message, path=e.path, expected=e.expected, found=e.found,
                              hint=f"{beside}; {e.hint}" if e.hint else beside) from None
        if draft is not None and problems:
            problems.append(f"the draft holds {held_draft / 1e9:.2f} GB"
                            + (" even streamed" if stream else ""))
        if problems and tipped_by_beside():
            problems.append(beside)
        if problems:
            raise BudgetError("; ".join(problems), hint="choose a smaller --preset or budgets")
    chunk = (opts.prefill_chunk or PREFILL_CHUNK, None, "") if budget is None else \
        prefill_chunk(budget, sizes, PREFILL_CHUNK, opts.prefill_chunk)
    store = run_store(opts)
    budget = store.noted(budget, sequence_bytes(sizes, load_rules().context_positions))
    if opts.batch_width is None:
        return budget, 1, (), bool(stream), chunk
    held = budget or Budget(sizes.trunk_bytes, sizes.cache_all_bytes, "resident", ())
    return (budget,) + batch_width(held, sizes, mem, opts.batch_width, held=store.states) + \
        (bool(stream), chunk)


def run_store(opts: RunOptions):
    """The state store's share of this run (``budget.store_share``)."""
    from ..budget import store_share
    return store_share(serve=opts.serve, batch=opts.batch_width is not None,
                       disk=bool(opts.prefix_cache), share_prefixes=opts.share_prefixes)


class Run:
    """An opened model plus the run's budget and optional trace writer."""

    def __init__(self, opts: RunOptions):
        from ..io.checkpoint import Checkpoint

        self.opts = opts
        self.budget = None
        self.trace = None
        ckpt = Checkpoint.open(opts.model)       # indexed once, for the budget and the run
        self.drafting = None
        count = None                       # the compile progress of both prepare calls
        try:
            if opts.load_state:     # a state of another model is refused before any compile
                from ..io.identity import weights_identity
                from ..model.state import check_file
                check_file(ckpt.config, opts.load_state, weights_identity(ckpt))
            draft = None
            if opts.draft:
                from ..draft.checkpoint import load_draft
                draft = load_draft(opts.draft, ckpt.config, read=False)
            self.budget, self.width, self.width_reasons, stream, \
                (self.prefill_chunk, cache_bytes, chunk_reason) = \
                resolve_run_budget(opts, ckpt, draft)
            if chunk_reason:
                self.budget = dataclasses.replace(
                    self.budget, reasons=self.budget.reasons + (chunk_reason,))
            if draft is not None:
                draft = load_draft(opts.draft, ckpt.config, stream=stream)
                if stream and opts.warn is not None:
                    opts.warn(f"the draft's {draft.nbytes / 1e9:.2f} GB do not fit beside "
                              "this budget: its matrices are read from disk at each draft pass")
            from ..engine.precompile import Count, prepare
            groups = ([] if opts.resident else ["expert-cache"]) + \
                self._kernel_groups(opts, ckpt)
            count = Count(groups, show=opts.progress)   # one counter over both calls
            # the expert cache builds its policy
            self.compile_seconds = (0.0 if opts.resident else
                                    prepare(["expert-cache"], show=opts.progress,
                                            count=count))
            on_route = self._record if opts.trace_path else None
            self.session = open_session(
                opts.model, ckpt=ckpt, pack=opts.pack,
                trunk_bytes=None if opts.resident else self.budget.trunk_bytes,
                cache_bytes=cache_bytes,
                cache_policy=opts.cache_policy, on_route=on_route,
                reads=Reads(opts.io_threads, opts.direct_io, opts.verify_reads,
                            tuple(opts.stripe_dirs) or None, opts.io_throttle_mbps),
                prefetch_experts=opts.prefetch_experts)
            self.drafting = start_drafting(opts, draft, self.session)
        except BaseException:
            if count is not None:
                count.close()
            ckpt.close()
            raise
        self.seq = 0                       # which prompt of a batch (trace records)
        self.prompts = Prompts(opts.model, self.session.tokenizer, opts.template_limits)
        try:    # the forward's kernels load while the session's first reads (lm_head, the
            # ring's layers) are under way
            self.compile_seconds += prepare(self._kernel_groups(opts, ckpt),
                                            show=opts.progress, count=count)
        except BaseException:
            self.close(failed=True)
            raise
        finally:
            count.close()
        if opts.trace_path:
            from .. import __version__
            from ..trace.format import TraceWriter, header_for_config
            self.trace = TraceWriter(opts.trace_path, header_for_config(
                self.cfg, created_by=f"k3-run {__version__}",
                meta={"model": str(opts.model), "pack": opts.pack,
                      "cache_policy": opts.cache_policy}))

    @staticmethod
    def _kernel_groups(opts: RunOptions, ckpt) -> list:
        """The precompile groups this run calls: the forward's or the draft's, and the
        image tower's when images may come and the checkpoint has one."""
        vision = ["vision"] if opts.vision and ckpt.vision_config is not None else []
        return ["draft" if opts.draft else "forward"] + vision

    def chunked(self, settings: GenSettings) -> GenSettings:
        """``settings`` with this run's prefill chunk (``resolve_run_budget``) and
        context (``context``)."""
        return dataclasses.replace(settings, prefill_chunk=self.prefill_chunk,
                                   context=self.context)

    @functools.cached_property
    def context(self) -> int:
        """The run's context in tokens: the model's (``config.context_length``), read
        once, or ``opts.context_limit`` (--ctx-size) when that is smaller."""
        from ..config import context_length
        model = context_length(self.opts.model)
        limit = self.opts.context_limit
        return model if limit is None else min(model, limit)

    @property
    def ctx_size(self) -> int | None:
        """--ctx-size when it sets ``context`` (it is not above the model's), else None."""
        limit = self.opts.context_limit
        return limit if limit is not None and limit == self.context else None

    @property
    def context_name(self) -> str:
        """What a refusal calls ``context``: the model's, or the one --ctx-size set."""
        return "the model's context" if self.ctx_size is None else \
            "the context set by --ctx-size"

    def check_fits(self, n_prompt: int, gen: int) -> None:
        """UsageError when --ctx-size is given and a prompt of ``n_prompt`` tokens and
        ``gen`` tokens after it (-1: until the end, nothing to add) do not fit in it."""
        limit = self.opts.context_limit
        if limit is None:
            return
        if n_prompt > self.context:
            raise UsageError(f"--ctx-size {limit}: the prompt is {n_prompt:,} tokens, over "
                             f"the context of {self.context:,}")
        if gen >= 0 and n_prompt + gen > self.context:
            raise UsageError(f"--ctx-size {limit}: the prompt's {n_prompt:,} tokens and "
                             f"--gen {gen:,} run past the context of {self.context:,}")

    @property
    def cfg(self):
        return self.session.cfg

    @functools.cached_property
    def prefix_cache(self):
        """The run's PrefixCache (formats/prefix-cache.md), or None without
        --prefix-cache."""
        if not self.opts.prefix_cache:
            return None
        from ..engine.prefix_cache import PrefixCache, default_directory
        where = self.opts.prefix_cache
        directory = default_directory(self.opts.pack) if where == "auto" else where
        s = self.session
        draft = None if self.drafting is None else self.drafting.proposer.identity
        return PrefixCache(directory, self.opts.prefix_cache_bytes, s.cfg, s.weights_identity,
                           s.pack_identity, warn=self.opts.warn, draft_identity=draft)

    @functools.cached_property
    def store(self):
        """A one-prompt run's or batch's state store (a server's: ``serve.turn_cache``)."""
        share = run_store(self.opts)
        if self.opts.serve or (self.prefix_cache is None and not share.ram_states):
            return None
        from ..store import StateStore
        return StateStore(self.cfg, share.ram_bytes, self.prefix_cache,
                          ram_states=share.ram_states)

    def _record(self, L, positions, ids, phase, tag=None):
        """One MoE layer's routing for a block of tokens: per token, its experts in
        selection order (formats/trace.md: within a prefill chunk, layer-major). ``tag``
        is the prompt's line in a batch decoded in lockstep, else ``self.seq``."""
        T, k = ids.shape
        rec = np.empty(T * k, RECORD_DTYPE)
        rec["pos"] = np.repeat(np.asarray(positions, np.int64), k)
        rec["seq"] = self.seq if tag is None else tag
        rec["layer"] = L
        rec["expert"] = ids.reshape(-1)
        rec["phase"] = {"prefill": PHASE_PREFILL, "predicted": PHASE_PREDICTED}.get(
            phase, PHASE_DECODE)
        self.trace.append_records(rec)

    def _tokenizer(self):
        return self.prompts.tokenizer

    def check_stop_ids(self, stop_ids) -> None:
        """--stop-id values against the model's vocabulary (the option can't know it)."""
        why = token_ids_problem(stop_ids, self.cfg.vocab_size)
        if why:
            raise UsageError(f"--stop-id: {why}")

    def encode(self, text: str, limit=None) -> list:
        return self.prompts.encode(text, limit)

    def encode_file(self, path) -> list:
        """Token ids of a prompt file's exact text (``prompt_file``); FormatError when
        the file, or its tokens, exceed the model's context."""
        from .prompt_file import prompt_byte_bound, read_prompt_file

        context = self.context
        bound = prompt_byte_bound(context, self._tokenizer().longest_rank_bytes)
        ids = self.encode(read_prompt_file(path, bound))
        self.check_fits(len(ids), 0)
        if len(ids) > context:
            raise FormatError("prompt is longer than the model's context", path=path,
                              expected=f"<= {context} tokens", found=f"{len(ids)} tokens")
        return ids

    def chat(self, warn=None):
        """Conversations' prompt ids and turn ends for this model (``Prompts.chat``)."""
        return self.prompts.chat(warn)

    def encode_messages(self, request: dict, warn=None, limit=None) -> list:
        return self.prompts.encode_messages(request, warn, limit)

    def chat_settings(self, settings: GenSettings, warn=None) -> GenSettings:
        """``settings`` that also stop at the assistant turn's end."""
        stops = tuple(dict.fromkeys(tuple(settings.stop_ids) + self.chat(warn).stop_ids()))
        return dataclasses.replace(settings, stop_ids=stops)

    def structured(self, settings: GenSettings) -> GenSettings:
        """``settings`` with their ``response_format`` compiled for this model's tokenizer
        (``grammar.compile_grammar``, cached by the format's text): UsageError when the
        format is refused, the model has no tokenizer or llguidance is missing."""
        if settings.response_format is None or settings.grammar is not None:
            return settings
        from ..constrain.grammar import compile_grammar
        return dataclasses.replace(settings, grammar=compile_grammar(
            self._tokenizer(), settings.response_format))

    def until_end(self, settings: GenSettings) -> GenSettings:
        """``settings`` whose ``gen`` -1 (until the end) also stops at the end of the
        model's turn (``chat_settings``), when the model has a tokenizer to name it."""
        if settings.gen != UNTIL_END or self.session.tokenizer is None:
            return settings
        return self.chat_settings(settings)

    def end_ids(self, settings: GenSettings) -> tuple:
        """The ids that end a generation under ``settings``, as ``generate`` runs it: its
        stop ids, the turn's end when it runs until the end, a format's end tokens."""
        s = self.structured(self.until_end(settings))
        return tuple(s.stop_ids) + (s.grammar.end_ids(s.stop_ids) if s.grammar else ())

    def reply_message(self, generated_ids, stop_strings=()) -> dict:
        """The assistant message parsed from a reply's ids (formats/chat.md), its text
        ending at a stop string (``stops``)."""
        from ..engine.stops import returned_pieces
        from ..text.chat_parse import parse_reply
        tok = self._tokenizer()
        if self.chat().template is None:
            return {"role": "assistant",
                    "content": returned_text(tok, generated_ids, stop_strings)}
        return parse_reply(returned_pieces(tok, generated_ids, stop_strings)).message()

    def report(self, res, extra=None) -> dict:
        stats = self.session.weights.stats()
        rep = run_report(res, stats, self.budget, extra)
        rep["model"] = str(self.opts.model)
        rep["pack"] = self.opts.pack
        rep["prefill_chunk"] = self.prefill_chunk
        rep["compile_seconds"] = round(self.compile_seconds, 6)
        rep["startup_seconds"] = startup_seconds(self.session.forward.first_layer_time)
        tok = self.session.tokenizer
        if tok is not None:
            # the token that ended it by its id (a turn's end) is not text of the reply
            rep["generated_text"] = returned_text(
                tok, res.generated_ids, res.stop_strings,
                res.generated_ids[-1:] if res.stop_reason == "stop_id" else ())
            rep["tokenizer_cache"] = tok.loaded.cache_status if tok.loaded else "not read"
        if res.spec is not None:
            rep["speculative"] = res.spec
        if res.grammar_seconds is not None:
            rep["grammar_mask_seconds"] = round(res.grammar_seconds, 6)
        return rep

    def check_stop_strings(self, settings: GenSettings) -> None:
        if settings.stop_strings and self.session.tokenizer is None:
            raise UsageError("--stop needs the model's tokenizer (tiktoken.model); use --stop-id")

    def generate(self, prompt_ids, settings: GenSettings, *, on_token=None, keep_logits=False,
                 load_state=None, save_state=None, should_stop=None, state=None,
                 save_prefix=False, logprobs=None, images=()):
        """One prompt, from ``state``, ``load_state``'s, the ``store``'s longest prefix of
        it (not when its logits are kept), or a new state. ``save_prefix``: keep the state
        the prompt leaves in the store; ``logprobs`` as ``generate``'s. ``should_stop()``
        is asked at every prefill chunk and token: True abandons the prompt (Abandoned,
        nothing saved). ``images``: ``forward.ImageRows`` at pads of the ids."""
        self.check_stop_strings(settings)
        settings = self.structured(self.until_end(settings))
        state = _load_state(self, load_state) if state is None and load_state else state
        why = room_problem(0 if state is None else state.pos, len(prompt_ids), settings.gen,
                           self.context, self.context_name)
        if why:
            raise UsageError(why)
        reuse = None if self.store is None else Reuse(
            self.store, resume=state is None, keep_at=(len(prompt_ids),) if save_prefix else ())
        fed = []                            # the state the prompt went into
        progress = _prefill_bar(len(prompt_ids), self.opts.progress)
        if should_stop is not None:
            progress, on_token = _checked(progress, should_stop), _checked(on_token, should_stop)
        res = generate(self.session.forward, state, Prompt(list(prompt_ids), tuple(images)),
                       settings, tokenizer=self.session.tokenizer, keep_logits=keep_logits,
                       hooks=Hooks(on_token, progress, fed.append), feed_last=bool(save_state),
                       drafting=self.drafting, logprobs=logprobs, reuse=reuse)
        if res.reused_tokens:
            res.prompt_ids = list(prompt_ids)
        if save_state:
            fed[0].save(save_state, self.session.weights_identity)
        return res

    def close(self, failed: bool = False) -> None:
        """Release the model; finish the trace, or after a failure keep it as the
        ``.partial`` a crash leaves, so a failed run never publishes a complete trace."""
        try:
            if self.trace is not None:
                self.trace.keep_partial() if failed else self.trace.close()
            if self.drafting is not None and self.drafting.on_dump is not None and not failed:
                self.drafting.on_dump.write()
        finally:
            self.session.weights.close()
            self.session.ckpt.close()


@contextlib.contextmanager
def open_run(opts: RunOptions):
    run = Run(opts)
    try:
        yield run
    except BaseException:
        run.close(failed=True)
        raise
    run.close()


def _load_state(run: Run, path) -> State:
    """The state saved at ``path`` (refused unless this run's weights computed it), or a
    new one."""
    if not path:
        return run.session.new_state()
    return State.load(run.cfg, path, run.session.weights_identity)


def _checked(callback, should_stop):
    def call(arg):
        if should_stop():
            raise Abandoned()
        if callback is not None:
            callback(arg)
    return call


def _prefill_bar(n: int, show: bool):
    """Progress of a prefill on stderr, for prompts over a chunk (``progress.bar``)."""
    if n <= PREFILL_CHUNK or not show:
        return None
    from .. import progress
    return progress.bar(total=n, unit="tok", desc="prefill").update
