"""``LLM``: the notebook / Python face of the engine (vLLM-style). The checkpoint's family
entry gives the checks, the loader and the engine (:func:`mtp_jax.engine.serving.make_engine`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Callable, Iterator, Sequence

from tqdm.auto import tqdm

from mtp_jax.cache_admin import cache_status, check_resize_fits
from mtp_jax.checks import check_before_load
from mtp_jax.compile_cache import enable_compilation_cache
from mtp_jax.default_model import default_model_path
from mtp_jax.engine import executable_prefetch
from mtp_jax.engine.executable_cache import cache_dir
from mtp_jax.engine.requests import ABORT, Request, RequestOutput, StreamOutput
from mtp_jax.engine.samples import sample_seed, split_ready, waits_for_first
from mtp_jax.engine.load_plan import check_memory_and_quantization
from mtp_jax.engine.serving import make_engine
from mtp_jax.llm_settings import llm_settings
from mtp_jax.models.checks import check_backends
from mtp_jax.models.loaded import resolve_dtype
from mtp_jax.models.loader import load_model, load_request
from mtp_jax.prompt_checks import PromptLimits, check_prompts_before_load, load_tokenizer
from mtp_jax.prompts import (chat_prompt, check_stops, error_output, params_list, prompt_ids,
                             prompt_list, request_output)
from mtp_jax.sampling import SamplingParams
from mtp_jax.speculative.external import Proposer
from mtp_jax.streaming import with_text
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.weights.quant_config import check_quantization_mode

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamOutput"]


def _prefetch_programs(model: str, args: dict) -> None:
    """Start loading the programs the last start-up with the same ``LLM`` arguments ``args``
    built first, from the executable cache (:mod:`mtp_jax.engine.executable_prefetch`), so
    that they load while the tokenizer is read."""
    settings = {k: v for k, v in args.items() if k not in ("self", "before_load", "proposer")}
    settings.update(model=os.path.abspath(model), proposer=args["proposer"] is not None)
    executable_prefetch.start(cache_dir(), repr(sorted(settings.items())))


class LLM:
    """Load a checkpoint and generate.

    Args:
      model: checkpoint folder (HF layout), or a Flash-Next ``.gguf`` file (docs/gguf.md);
        ``None`` uses the built-in default model (a small qwen3_5_moe, a tiny target with a
        trained MTP head, with the real Qwen3.5 tokenizer, made once in a cache folder).
      dtype: ``"auto"`` (bf16 on GPU, f32 on CPU), ``"bfloat16"``, ``"float16"``, ``"float32"``.
      max_running_requests: requests in flight at once (batch bucket limit).
      speculative_algorithm: ``"mtp"`` (the default: the checkpoint's MTP layer drafts; a
        checkpoint without one is refused unless ``speculative_draft_model_path`` gives one),
        ``"external"`` (drafts from ``proposer``) or ``"none"``/``None``.
      speculative_num_steps: k drafted tokens per round, 1..8 (default 3); 0 is also taken
        with speculation off, where it is unused.
      speculative_draft_model_path: a folder holding the ``mtp.*`` draft tensors (default: the
        target checkpoint itself).
      speculative_draft_vocab_size, speculative_token_map: MTP only; the draft scores only a
        hot subset of N token ids (FR-Spec, SGLang's ``speculative_token_map``), which cuts the
        draft's LM-head bytes by about V/N. The map is a ``.npy`` / ``.json`` / text file of
        token ids (the hot set, in order); a size alone takes the N lowest ids (a heuristic:
        BPE ids follow merge order, so low ids are frequent; a map counted on real traffic is
        better); both: the map's first N. Output stays exact (greedy: plain decoding; sampled:
        the target's distribution); the accept length may drop a little. Default: the full
        vocabulary. See :mod:`mtp_jax.speculative.draft_vocab`.
      speculative_draft_head_dtype: MTP only; ``"int8"`` scores drafts with an int8 copy of
        the LM head (a float32 scale per row; the 8 blocks of 32 rows holding the best logits
        re-scored in the model dtype): 1 byte per weight read per draft step instead of 2
        (bf16), for the memory of that copy (N x (H + 4) bytes, N = V or the hot ids).
        Output stays exact; greedy drafts are the model-dtype head's but for a quantization
        error as large as the gap between the best and the 8th logit. ``None`` or
        ``"model"``: the model dtype. Default ``"auto"``: int8 for a bfloat16 / float16 model
        on an accelerator, else the model dtype (:mod:`mtp_jax.speculative.draft_dtypes`).
        See :mod:`mtp_jax.models.draft_head`.
      speculative_draft_layer_dtype: MTP only; ``"int8"`` runs the draft's projections (its
        ``fc`` and its decoder layer's attention and dense MLP projections; a MoE layer's
        router and shared-expert gate, not its routed experts) from an int8 copy with a float32
        scale per row: about half the draft layer's bytes per draft step, for the memory of
        that copy (out x (in + 4) bytes per projection). Output stays exact; the drafts, hence
        the accept length, may change a little. ``None`` or ``"model"``: the model dtype.
        Default ``"auto"``, as for the head.
      speculative_adaptive: draft only when it pays (default True): each request drafts only
        while its accepted drafts pay for a round, else it decodes plainly and probes again
        now and then; ``speculative_num_steps`` is the most a round drafts. Output is exact
        either way, and a request's tokens do not depend on the requests beside it. See
        :mod:`mtp_jax.speculative.adaptive`.
      speculative_adaptive_round_cost: a round's time in decode steps (1..100) that a
        request's drafting must beat; None (default): the byte ratio of a round and a step
        at batch 1, plus 0.15.
      proposer: for ``"external"``: ``(request_id, token_ids_so_far, k) -> k token ids``.
      seed: base seed of sampled requests without their own seed.
      max_model_len, page_size: KV sizing (tokens).
      chunked_prefill_size: prompt tokens prefilled per scheduler step (default 2048); longer
        prompts are prefilled in chunks interleaved with the running requests' rounds.
      max_prefill_batch: requests' prompt chunks per prefill call (default 8; 1: one each).
      enable_prefix_cache: reuse KV pages, GDN snapshots and draft KV of shared prompt prefixes
        (default True); ``flush_cache()`` empties it.
      overlap_schedule: dispatch each round before reading the previous one's result, so the
        host's per-round work runs while the device computes (default True; tokens surface
        one round later, outputs are identical; ``False`` waits for every round).
      num_scheduler_steps: rounds (decode steps, or speculative rounds) per program call
        (multi-step scheduling as vLLM's); ``None`` (the default): the engine chooses
        (:func:`~mtp_jax.engine.rounds.auto_rounds_per_call`: 4, fewer with speculation and the
        prefix cache so that no snapshot boundary passes unsaved, 1 for an external proposer).
        Above 1 the host's per-call work is paid once for that many rounds: faster where the
        host, not the device, bounds a round (a small model at batch 1); tokens surface in
        groups, outputs are identical. Not above 1 with ``speculative_algorithm="external"``.
      mem_fraction: fraction of device memory for weights and pools (default 0.9);
      max_total_tokens: KV positions for all requests together (wins over ``mem_fraction``).
      ple_backend: qwen4_exp only (a ConfigError for other families): where the PLE n-gram
        tables live, ``"disk"`` (memory-mapped), ``"memory"`` (host RAM), ``"device"``
        (copied to the accelerator: the programs look their rows up inside the program, no
        host callback, so the programs can be saved in the executable cache; the tables must
        fit, ``rows * ngram_head_dim`` values of the model dtype per PLE layer,
        ``ngram_head_dim = ple_embed_dim / ((ngram_size - 1) * heads_per_ngram)``; for
        cut-down shapes and small models, not the released ~100 GB tables) or ``"auto"`` /
        None (the default: ``device`` on an accelerator where the tables take at most a
        quarter of its memory, else ``disk``). All give the same tokens.
      attention_backend, gdn_backend, moe_backend, norm_backend, gemv_backend: ``"auto"``
        (default), ``"xla"`` or ``"pallas"``: the implementation of paged attention, the GDN
        decode/verify/commit step form, the MoE experts and router, the decoder layers'
        residual add + RMSNorm, and the projections and LM heads of one-row calls
        (:mod:`mtp_jax.kernels`); ``pallas`` needs a CUDA GPU. ``gemv_backend`` also takes
        ``"reduce"`` (XLA's multiply-reduce form), which ``"auto"`` picks on a GPU.
      compilation_cache_dir: persistent XLA compilation cache folder (compiled programs reused
        by the next process); ``None``: ``$MTP_JAX_COMPILATION_CACHE``, else the folder jax
        already uses, else ``~/.cache/mtp_jax/xla``; ``"none"``/``"off"``: no cache
        (:mod:`mtp_jax.compile_cache`; an unwritable folder raises ConfigError).
      quantization: how a quantized checkpoint's projections (block FP8, ModelOpt FP8 /
        NVFP4, compressed-tensors NVFP4) are held: ``"keep"`` (kept as stored, dequantized
        inside each program: FP8 half and NVFP4 about 0.28 of the bf16 bytes),
        ``"dequantize"`` (dequantized to ``dtype`` at load) or ``"auto"`` (default:
        ``"dequantize"``, measured faster, unless only the kept weights fit the device, then
        ``"keep"`` with a warning; :mod:`mtp_jax.engine.load_plan`); the output is the same
        either way (docs/quantization.md).
      dummy_weight: random weights of the checkpoint's shapes instead of its weights (benchmarks,
        tests of the non-speculative path); refused with ``speculative_algorithm="mtp"``.
      before_load: ``fn(tokenizer, limits)``, called once the settings and the config passed
        their checks and the tokenizer is read, before any weight loads: what it raises stops
        the construction there. ``limits`` (:class:`~mtp_jax.prompt_checks.PromptLimits`): the
        vocabulary and context limit. The CLI checks its prompts here
        (:mod:`mtp_jax.cli_prompts`); Python callers can use :meth:`check_prompts`.
    Raises:
      ConfigError: bad settings, before any weight is read
        (:func:`mtp_jax.checks.check_before_load`);
      CheckpointError: bad weight files, before any tensor data is read.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 max_running_requests: int = 8, speculative_algorithm: str | None = "mtp",
                 speculative_num_steps: int = 3, speculative_draft_model_path: str | None = None,
                 speculative_draft_vocab_size: int | None = None,
                 speculative_token_map: str | None = None,
                 speculative_draft_head_dtype: str | None = "auto",
                 speculative_draft_layer_dtype: str | None = "auto",
                 speculative_adaptive: bool = True,
                 speculative_adaptive_round_cost: float | None = None,
                 proposer: Proposer | None = None, seed: int = 0, max_model_len: int = 4096,
                 page_size: int = 16, dummy_weight: bool = False,
                 chunked_prefill_size: int = 2048, max_prefill_batch: int = 8,
                 enable_prefix_cache: bool = True, overlap_schedule: bool = True,
                 num_scheduler_steps: int | None = None, mem_fraction: float = 0.9,
                 max_total_tokens: int | None = None,
                 ple_backend: str | None = None, attention_backend: str = "auto",
                 gdn_backend: str = "auto", moe_backend: str = "auto",
                 compilation_cache_dir: str | None = None, norm_backend: str = "auto",
                 gemv_backend: str = "auto", quantization: str = "auto",
                 before_load: Callable[[Tokenizer | None, PromptLimits], None] | None = None):
        args = dict(locals())
        enable_compilation_cache(compilation_cache_dir)  # before anything compiles
        check_quantization_mode(quantization)
        backends = dict(attention=attention_backend, gdn=gdn_backend, moe=moe_backend,
                        norm=norm_backend, gemv=gemv_backend)
        check_backends(backends, dtype=resolve_dtype(dtype))  # errors first
        if model is None:
            model = default_model_path()
        _prefetch_programs(model, args)  # loaded while the tokenizer is read
        speculative, engine_cfg = llm_settings(args)
        algorithm = speculative.algorithm
        self.seed = seed
        self.speculative = speculative  # the speculative settings in use
        self._next_id = 0
        self._open_call = None  # the generate / generate_stream call being served, if any
        request = load_request(engine_cfg.dtype, with_mtp=algorithm == "mtp",
                               draft_path=speculative_draft_model_path,
                               dummy_weight=dummy_weight, backends=backends,
                               ple_backend=ple_backend, quantization=quantization)
        # Every config-time check, before any weight (or the tokenizer) is read.
        model_cfg = check_before_load(model, speculative=speculative, engine=engine_cfg,
                                      dummy_weight=dummy_weight,
                                      has_proposer=proposer is not None, request=request)
        request = check_memory_and_quantization(model, model_cfg, engine_cfg, speculative,
                                                request, dummy_weight, ple_backend)
        self.tokenizer = load_tokenizer(model)  # the one a check_prompts call just read
        if before_load is not None:
            before_load(self.tokenizer, PromptLimits.of(model_cfg, engine_cfg.max_model_len))
        self.model = load_model(model, engine_cfg.dtype, with_mtp=algorithm == "mtp",
                                dummy_weight=dummy_weight, cfg=model_cfg,
                                draft_path=speculative_draft_model_path, ple_backend=ple_backend,
                                quantization=request.quantization,  # auto: resolved
                                **{f"{op}_backend": v for op, v in backends.items()})
        self.engine = make_engine(self.model, engine_cfg, speculative, proposer=proposer,
                                  tokenizer=self.tokenizer)

    def resize_cache(self, *, num_pages: int | None = None,
                     max_running_requests: int | None = None) -> None:
        """Grow or shrink the KV pool (``num_pages``, with the draft KV) and/or the per-slot
        state pool (``max_running_requests``: GDN state, pending tokens, draft distributions)
        between generate calls. See :meth:`Engine.resize_cache`. Sizes that do not fit the
        memory budget (:func:`mtp_jax.cache_admin.check_resize_fits`) raise ``ConfigError``
        before anything is freed: the caches stay as they were."""
        check_resize_fits(self.engine, num_pages, max_running_requests)
        self.engine.resize_cache(num_pages=num_pages, max_running_requests=max_running_requests)

    def cache_status(self) -> dict:
        """Pool sizes and use (KV pages, slots, queued and running requests, prefix cache);
        :func:`mtp_jax.cache_admin.cache_status`."""
        return cache_status(self.engine)

    def get_tokenizer(self) -> Tokenizer | None:
        """The checkpoint's tokenizer (:class:`mtp_jax.tokenizer.Tokenizer`: ``encode``,
        ``decode``, ``apply_chat_template``), as vLLM's ``LLM.get_tokenizer``; None for a
        checkpoint without tokenizer files (prompts are then token ids)."""
        return self.tokenizer

    @staticmethod
    def check_prompts(prompts, model: str | None = None, *, max_model_len: int = 4096,
                      sampling_params=None, chat: bool = False,
                      chat_template_kwargs: dict | None = None) -> list[list[int]]:
        """Tokenize and check ``prompts`` (as for :meth:`generate`) before any weight loads:
        reads only the checkpoint's ``config.json`` and tokenizer files (``model`` None: the
        built-in default model), so a bad prompt is refused in seconds, not after the load.
        ``chat``: ``prompts`` is a conversation (``[{"role": ..., "content": ...}, ...]``, as
        :meth:`chat` takes) or a list of them, each checked as the text :meth:`chat` renders
        from it (the chat template, generation prompt added, ``chat_template_kwargs`` as
        :meth:`chat` takes them).
        Returns each prompt's token ids. Raises ``ValueError`` naming every refused prompt
        (``prompts[i]``): empty, too long for the context limit (``min(max_model_len,
        max_position_embeddings)``: its token count, the limit and the fix), ids outside the
        vocabulary, text without a tokenizer, a conversation without one (no chat template)
        or that the template refuses, or, with ``sampling_params``, stops that cannot fire;
        ``ConfigError`` for a folder ``LLM(model)`` would refuse. ``LLM(model)`` then reuses
        the tokenizer read here; :meth:`generate` checks every prompt again."""
        return check_prompts_before_load(prompts, default_model_path() if model is None
                                         else model, max_model_len, sampling_params, chat=chat,
                                         template_kwargs=chat_template_kwargs)

    # ---- requests ----------------------------------------------------------------------------
    def new_requests(self, prompt, params: SamplingParams) -> list[Request]:
        """The ``params.n`` engine requests (:class:`Request`, the samples) of one prompt
        (text or token ids) and its validated ``params``, for a caller that drives
        ``self.engine`` itself (the server); seeds and ids as :meth:`generate` gives them.
        Samples 1..n-1 should join the engine once
        :func:`~mtp_jax.engine.samples.waits_for_first` is false. Raises
        ``ValueError`` for a bad prompt or params."""
        params_list(params, 1)
        return self._samples(prompt, params)

    def _samples(self, prompt, params: SamplingParams) -> list[Request]:
        """The ``params.n`` requests of ``prompt``: sample i seeded ``params.seed + i`` when a
        seed is given (else by its own request index), samples 1..n-1 linked to sample 0."""
        vocab = self.model.cfg.vocab_size
        text, ids = prompt_ids(prompt, self.tokenizer, vocab, self.engine.max_model_len,
                               max_positions=self.model.cfg.max_position_embeddings)
        check_stops(params, vocab, self.tokenizer)
        out: list[Request] = []
        for i in range(params.n):
            index = self._next_id
            self._next_id += 1
            seed = (sample_seed(params.seed, i) if params.seed is not None
                    else (self.seed * 1000003 + index) % 2**32)
            out.append(Request(request_id=str(index), index=index, prompt=text,
                               prompt_ids=list(ids), params=params, seed=seed,
                               sample_index=i, first=out[0] if out else None))
        return out

    def _output(self, r: Request) -> RequestOutput:
        return request_output(r, self.tokenizer)

    def _prepare(self, prompts, sampling_params):
        """Validate and turn prompts into requests: ``(outputs, [(index, Request)])`` where
        ``outputs`` (one per sample: prompt-major, ``n`` per prompt) already holds the error
        outputs of bad prompts (see :meth:`generate`)."""
        prompts = prompt_list(prompts)
        sampling_params = params_list(sampling_params, len(prompts))
        outputs: list[RequestOutput | None] = []
        requests: list[tuple[int, Request]] = []
        for p, sp in zip(prompts, sampling_params):
            try:
                group = self._samples(p, sp)
            except ValueError as e:
                if len(prompts) == 1:
                    raise
                for i in range(sp.n):
                    outputs.append(error_output(str(self._next_id), p, str(e)))
                    outputs[-1].sample_index = i
                    self._next_id += 1
                continue
            requests += [(len(outputs) + i, r) for i, r in enumerate(group)]
            outputs += [None] * len(group)
        return outputs, requests

    def generate(self, prompts,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for ``prompts``: a string, a token-id list, a ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}`` dict (vLLM's ``TextPrompt`` / ``TokensPrompt``), or a
        list of any of these.

        ``sampling_params``: one for all or one per prompt (default ``SamplingParams()``).
        ``use_tqdm``: a progress bar over finished requests.
        Returns one :class:`RequestOutput` per prompt, in order; with ``n > 1``, ``n`` per
        prompt, prompt-major (sample i at ``sample_index`` i), as OpenAI orders a call's
        choices. Samples of a prompt share its prefix-cache pages
        (:mod:`mtp_jax.engine.samples`).

        Raises ``ValueError`` before any work for invalid sampling parameters. A bad prompt
        (empty, too long for ``max_model_len``, token ids outside the vocabulary, text without a
        tokenizer) raises when it is the only prompt; among several, it gets an output with
        ``finish_reason="error"`` and ``error`` set to the message, and the others run normally.
        An exception while generating (a failed engine step, ``KeyboardInterrupt``) is raised
        after this call's requests were aborted, and the next call starts on an empty engine
        (:meth:`mtp_jax.engine.engine.Engine.step`): its greedy outputs and explicitly seeded
        samples are a fresh LLM's (unseeded requests take seeds from the request count, which
        the failed call advanced).
        """
        outputs, requests = self._prepare(prompts, sampling_params)
        with contextlib.closing(self._stream(outputs, requests, use_tqdm)) as stream:
            for _ in stream:  # closed, its requests aborted, on an exception (Ctrl-C too)
                pass
        for i, r in requests:
            outputs[i] = self._output(r)
        return outputs

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[StreamOutput]:
        """Like :meth:`generate`, but yields a :class:`StreamOutput` each time a request gains
        tokens (after its prefill and after each round; ``new_text``: the text they add), the
        last one with ``finished`` set and the complete ``output``. Error outputs of bad
        prompts are yielded first. Closing the stream before its end (``stream.close()``)
        aborts its unfinished requests; errors are handled as in :meth:`generate`."""
        outputs, requests = self._prepare(prompts, sampling_params)
        stops = {i: r.params.stop for i, r in requests}
        yield from with_text(self._stream(outputs, requests, False), self.tokenizer, stops)

    def _stream(self, outputs, requests, use_tqdm: bool) -> Iterator[StreamOutput]:
        """Yield the error outputs of bad prompts, then serve ``requests`` and yield each
        step's new tokens. When anything raises in here (an engine step, ``add_request``) or
        the stream is closed before its end, this call's requests still in the engine are
        aborted and the exception goes on, so the next call starts on an empty engine. A call
        that starts while an earlier stream is still open (neither exhausted nor closed, e.g.
        kept alive by a traceback) aborts that stream's requests, with a warning; that stream
        raises ``RuntimeError`` if resumed. Every request gets a last item with ``finished``
        set, one aborted between steps (``Engine.abort``) too."""
        self._close_open_call()
        call = self._open_call = object()
        reqs = [r for _, r in requests]
        bar, live = None, {id(r): (i, r) for i, r in requests}  # no last item yielded yet
        prefix, held = self.engine.prefix, []  # samples 1..n-1 waiting for sample 0's prompt
        try:
            bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not use_tqdm)
            for i, out in enumerate(outputs):
                if out is not None:
                    yield StreamOutput(index=i, request_id=out.request_id, new_token_ids=[],
                                       finished=True, output=out,
                                       sample_index=out.sample_index)
                    self._check_open(call)
            for r in reqs:
                if waits_for_first(r, prefix):
                    held.append(r)
                else:
                    self.engine.add_request(r)
            aborts = self.engine.abort_count
            while True:
                if self.engine.abort_count != aborts:  # some taken out between steps
                    aborts = self.engine.abort_count
                    for i, r in [x for x in live.values() if x[1].finished]:
                        del live[id(r)]  # no step reports them: their last item here
                        bar.update(1)
                        yield StreamOutput(index=i, request_id=r.request_id, new_token_ids=[],
                                           finished=True, output=self._output(r),
                                           sample_index=r.sample_index)
                        self._check_open(call)
                    continue  # an abort while those were read is looked for again
                ready, held = split_ready(held, prefix)
                for r in ready:
                    self.engine.add_request(r)
                if not self.engine.has_work():
                    break
                for r, new in self.engine.step().items():
                    done = r.finished
                    bar.update(int(done))
                    i = live.pop(id(r))[0] if done else live[id(r)][0]
                    yield StreamOutput(index=i, request_id=r.request_id,
                                       new_token_ids=list(new), finished=done,
                                       output=self._output(r) if done else None,
                                       sample_index=r.sample_index,
                                       new_logprobs=_new_logprobs(r, len(new)))
                    self._check_open(call)
        except BaseException:  # GeneratorExit too: a stream closed early
            self.engine.abort(reqs)
            for r in held:  # never in the engine
                r.finish_reason = ABORT
            raise
        finally:
            if bar is not None:
                bar.close()
            if self._open_call is call:
                self._open_call = None

    def _check_open(self, call) -> None:
        """Raise ``RuntimeError`` when a later call aborted the requests of ``call`` (a stream
        resumed after it; see :meth:`_stream`)."""
        if self._open_call is not call:
            raise RuntimeError("this generate_stream was left open while a later call started, "
                               "which aborted its requests.")

    def _close_open_call(self) -> None:
        """Before a call: abort what earlier calls left in the engine, with a warning — the
        requests of a stream left open (see :meth:`_stream`), or of a call whose own clean-up
        was interrupted — and make its pools usable (``Engine.make_ready``)."""
        was_open, self._open_call = self._open_call is not None, None
        aborted = self.engine.make_ready()
        if was_open:
            warnings.warn(f"an earlier generate_stream was left open (not read to its end nor "
                          f"closed); its {len(aborted)} unfinished requests were aborted. Close "
                          "a stream you stop reading (stream.close()).", RuntimeWarning,
                          stacklevel=4)
        elif aborted:
            warnings.warn(f"an earlier call left {len(aborted)} unfinished requests in the "
                          "engine (its clean-up after an error was interrupted); they were "
                          "aborted.", RuntimeWarning, stacklevel=4)

    def warmup(self, prompts, sampling_params=None, lean: bool = False,
               background: bool = False) -> float:
        """Compile, before timing anything, the programs that generating ``prompts`` with
        ``sampling_params`` (as for :meth:`generate`) can call: their prompt-length and batch
        buckets, sampling variant and prefix-cache snapshot variants. ``lean``: only the
        largest prompt-chunk and batch bucket, which later calls pad up to (a faster start for
        a one-off run, slower rounds once fewer requests run than that bucket holds; in force
        until a warm-up without ``lean`` or a :meth:`resize_cache`). ``background``: compile
        on a thread and return at once; each call then waits for its own program only (the
        first token comes after the prefill program alone; ``python -m mtp_jax.generate`` does
        both). Prompts :meth:`generate` would refuse are skipped. Returns seconds spent."""
        next_id = self._next_id  # warm-up requests must not shift the default seeds
        try:
            _, requests = self._prepare(prompts, sampling_params) if prompts else ([], [])
        except ValueError:
            requests = []  # generate() reports it
        finally:
            self._next_id = next_id
        return self.engine.warmup_for([r for _, r in requests], lean=lean, background=background)

    def flush_cache(self) -> None:
        """Empty the prefix cache (entries that running requests use stay)."""
        self.engine.flush_cache()

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters: lookups, hits, prompt tokens, reused tokens."""
        if self.engine.prefix is None:
            return {}
        return dataclasses.asdict(self.engine.prefix.stats)

    def chat(self, messages: list, sampling_params=None, *,
             chat_template_kwargs: dict | None = None, use_tqdm: bool = False):
        """Apply the chat template to ``messages`` (:func:`mtp_jax.prompts.chat_prompt`) and
        generate the reply. ``messages``: one conversation (``[{"role": ..., "content": ...},
        ...]``; returns its reply, one :class:`RequestOutput`) or a list of conversations
        (returns their replies, a list in order, as vLLM's ``LLM.chat``; ``sampling_params``
        one for all or one per conversation, as :meth:`generate` takes them; a conversation
        the template cannot render raises before any work). ``chat_template_kwargs``:
        variables the template reads, as vLLM's (e.g. ``{"enable_thinking": False}`` with
        Qwen's templates: an empty think block, so the reply starts at once); a key the
        template does not read is a ``ValueError`` naming those it does. :meth:`check_prompts`
        with ``chat=True`` checks conversations before the load."""
        several = (isinstance(messages, (list, tuple)) and len(messages) > 0
                   and all(isinstance(c, (list, tuple)) for c in messages))
        prompts = [chat_prompt(c, self.tokenizer, chat_template_kwargs)
                   for c in (messages if several else [messages])]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        return outputs if several else outputs[0]


def _new_logprobs(r: Request, count: int):
    """The :class:`TokenLogprob` items of ``r``'s last ``count`` output tokens (None when it did
    not ask for them)."""
    if r.params.logprobs is None:
        return None
    end = len(r.output_ids)
    return r.logprobs[end - count:end]

