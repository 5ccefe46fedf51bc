"""``LLM``: the notebook / Python face of the engine (vLLM-style)."""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import warnings
from collections.abc import Iterable
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from mtp_jax.checks import check_before_load
from mtp_jax.config import (EngineConfig, SpecConfig, normalize_algorithm,
                            normalize_draft_dtype)
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, RequestOutput, SamplingParams, StreamOutput
from mtp_jax.models.loader import load_model, resolve_dtype
from mtp_jax.spec.external import Proposer

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamOutput"]


def _is_qwen4_exp_folder(path: str) -> bool:
    import json
    import os

    from mtp_jax.models.qwen4_exp.config import is_qwen4_exp

    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False  # the regular checks report it
    return isinstance(raw, dict) and is_qwen4_exp(raw)


class LLM:
    """Load a checkpoint and generate.

    Args:
      model: checkpoint folder (HF layout); ``None`` uses the built-in default model (a small
        random-weight qwen3_5_moe with the real Qwen3.5 tokenizer, made once in a cache folder).
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
        vocabulary. See :mod:`mtp_jax.spec.draft_vocab`.
      speculative_draft_head_dtype: MTP only; ``"int8"`` scores drafts with an int8 copy of
        the LM head (a float32 scale per row; the 8 blocks of 32 rows holding the best logits
        re-scored in the model dtype): 1 byte per weight read per draft step instead of 2
        (bf16), for the memory of that copy (N x (H + 4) bytes, N = V or the hot ids).
        Output stays exact; greedy drafts are the model-dtype head's but for a quantization
        error as large as the gap between the best and the 8th logit. Default ``None`` (or
        ``"model"``): the model dtype. See :mod:`mtp_jax.models.draft_head`.
      speculative_draft_layer_dtype: MTP only; ``"int8"`` runs the draft's projections (its
        ``fc`` and its decoder layer's attention and dense MLP projections; a MoE layer's
        router and shared expert, not its routed experts) from an int8 copy with a float32
        scale per row: about half the draft layer's bytes per draft step, for the memory of
        that copy (out x (in + 4) bytes per projection). Output stays exact; the drafts, hence
        the accept length, may change a little. Default ``None`` (or ``"model"``): the model
        dtype.
      proposer: for ``"external"``: ``(request_id, token_ids_so_far, k) -> k token ids``.
      seed: base seed of sampled requests without their own seed.
      max_model_len, page_size: KV sizing (tokens).
      chunked_prefill_size: prompt tokens prefilled per scheduler step (default 2048); longer
        prompts are prefilled in chunks interleaved with the running requests' rounds.
      enable_prefix_cache: reuse KV pages, GDN snapshots and draft KV of shared prompt prefixes
        (default True); ``flush_cache()`` empties it.
      overlap_schedule: dispatch each round before reading the previous one's result, so the
        host's per-round work runs while the device computes (default True; tokens surface
        one round later, outputs are identical; ``False`` waits for every round).
      num_scheduler_steps: rounds (decode steps, or speculative rounds) per program call
        (default 1; multi-step scheduling as vLLM's). Above 1 the host's per-call work is paid
        once for that many rounds: faster where the host, not the device, bounds a round (a
        small model at batch 1); tokens surface in groups, outputs are identical. Not with
        ``speculative_algorithm="external"``.
      mem_fraction: fraction of device memory for weights and pools (default 0.9);
      max_total_tokens: KV positions for all requests together (wins over ``mem_fraction``).
      ple_backend: qwen4_exp only: where the PLE n-gram tables live, ``"disk"`` (memory-mapped,
        default) or ``"memory"`` (host RAM). qwen4_exp runs plain decoding, one request at a
        time, for now.
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
      dummy_weight: random weights of the checkpoint's shapes instead of its weights (benchmarks,
        tests of the non-speculative path); refused with ``speculative_algorithm="mtp"``.
    Raises:
      ConfigError: bad settings, before any weight is read (:func:`mtp_jax.checks.check_before_load`);
      CheckpointError: bad weight files, before any tensor data is read.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto",
                 max_running_requests: int = 8, speculative_algorithm: str | None = "mtp",
                 speculative_num_steps: int = 3, speculative_draft_model_path: str | None = None,
                 speculative_draft_vocab_size: int | None = None,
                 speculative_token_map: str | None = None,
                 speculative_draft_head_dtype: str | None = None,
                 speculative_draft_layer_dtype: str | None = None,
                 proposer: Proposer | None = None, seed: int = 0, max_model_len: int = 4096,
                 page_size: int = 16, dummy_weight: bool = False,
                 chunked_prefill_size: int = 2048, enable_prefix_cache: bool = True,
                 overlap_schedule: bool = True, num_scheduler_steps: int = 1,
                 mem_fraction: float = 0.9, max_total_tokens: int | None = None,
                 ple_backend: str = "disk", attention_backend: str = "auto",
                 gdn_backend: str = "auto", moe_backend: str = "auto",
                 compilation_cache_dir: str | None = None, norm_backend: str = "auto",
                 gemv_backend: str = "auto"):
        from mtp_jax.compile_cache import enable_compilation_cache

        enable_compilation_cache(compilation_cache_dir)  # before anything compiles
        from mtp_jax.kernels import KernelBackends

        backends = dict(attention_backend=attention_backend, gdn_backend=gdn_backend,
                        moe_backend=moe_backend, norm_backend=norm_backend,
                        gemv_backend=gemv_backend)
        KernelBackends.resolve(attention_backend, gdn_backend, moe_backend,
                               dtype=resolve_dtype(dtype), norm=norm_backend,
                               gemv=gemv_backend)  # errors first
        if model is None:
            from mtp_jax.default_model import default_model_path

            model = default_model_path()
        algorithm = normalize_algorithm(speculative_algorithm)
        spec = SpecConfig(algorithm=algorithm, num_steps=speculative_num_steps,
                          draft_model_path=speculative_draft_model_path,
                          draft_vocab_size=speculative_draft_vocab_size,
                          token_map_path=speculative_token_map,
                          draft_head_dtype=normalize_draft_dtype(
                              speculative_draft_head_dtype),
                          draft_layer_dtype=normalize_draft_dtype(
                              speculative_draft_layer_dtype))
        engine_cfg = EngineConfig(max_running_requests=max_running_requests, page_size=page_size,
                                  max_model_len=max_model_len, dtype=resolve_dtype(dtype),
                                  chunked_prefill_size=chunked_prefill_size,
                                  enable_prefix_cache=enable_prefix_cache,
                                  overlap_schedule=overlap_schedule,
                                  num_scheduler_steps=num_scheduler_steps,
                                  mem_fraction=mem_fraction, max_total_tokens=max_total_tokens)
        self.seed = seed
        self.spec = spec  # the speculative settings in use (SpecConfig)
        self._next_id = 0
        self._open_call = None  # the generate / generate_stream call being served, if any
        if _is_qwen4_exp_folder(model):
            if set(backends.values()) - {"auto", "xla"}:
                from mtp_jax.config import ConfigError

                raise ConfigError(f"qwen4_exp runs the XLA kernels only for now ({backends} "
                                  "was asked for); use the xla or auto backends.")
            self._init_qwen4_exp(model, spec, engine_cfg, dummy_weight, ple_backend)
            return
        # Every config-time check, before any weight (or the tokenizer) is read.
        model_cfg = check_before_load(model, spec=spec, engine=engine_cfg,
                                      dummy_weight=dummy_weight,
                                      has_proposer=proposer is not None)
        self._plan_before_load(model_cfg, engine_cfg, spec, algorithm)
        from mtp_jax.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_folder(model)
        self.model = load_model(model, engine_cfg.dtype, with_mtp=algorithm == "mtp",
                                dummy_weight=dummy_weight, cfg=model_cfg,
                                draft_path=speculative_draft_model_path, **backends)
        self.engine = Engine(self.model, engine_cfg, spec, proposer=proposer,
                             tokenizer=self.tokenizer)

    def _init_qwen4_exp(self, model, spec, engine_cfg, dummy_weight, ple_backend) -> None:
        from mtp_jax.config import ConfigError
        from mtp_jax.engine.sequential import SequentialEngine
        from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
        from mtp_jax.models.qwen4_exp.loader import load_qwen4_exp
        from mtp_jax.tokenizer import Tokenizer

        if (spec.draft_vocab_size is not None or spec.token_map_path is not None
                or spec.draft_head_dtype is not None or spec.draft_layer_dtype is not None):
            raise ConfigError("speculative_draft_vocab_size (--speculative-draft-vocab-size) / "
                              "speculative_token_map (--speculative-token-map) / "
                              "speculative_draft_head_dtype (--speculative-draft-head-dtype) / "
                              "speculative_draft_layer_dtype (--speculative-draft-layer-dtype) "
                              "set the MTP draft's weights, but qwen4_exp runs without "
                              "speculation for now; drop them.")
        if spec.enabled:
            raise ConfigError(f"speculative_algorithm {spec.algorithm!r} is not supported for "
                              "qwen4_exp yet (its verify/commit programs are not built); use "
                              "speculative_algorithm='none' (--speculative-algorithm none).")
        if dummy_weight:
            raise ConfigError("dummy weights are not supported for qwen4_exp yet; write a random "
                              "checkpoint with mtp_jax.models.qwen4_exp.random_checkpoint.")
        if engine_cfg.num_scheduler_steps != 1:
            raise ConfigError(f"num_scheduler_steps (--num-scheduler-steps) "
                              f"{engine_cfg.num_scheduler_steps}: qwen4_exp runs one decode step "
                              "per call for now; use 1 (the default).")
        if ple_backend not in ("disk", "memory"):
            raise ConfigError(f"ple_backend {ple_backend!r} is unknown; use 'disk' or 'memory'.")
        engine_cfg.validate()
        cfg = Qwen4ExpConfig.from_folder(model)
        self.tokenizer = Tokenizer.from_folder(model)
        self.model = load_qwen4_exp(model, engine_cfg.dtype, with_mtp=False,
                                    ple_backend=ple_backend, cfg=cfg)
        self.engine = SequentialEngine(self.model, engine_cfg.max_model_len, self.tokenizer)

    @staticmethod
    def _plan_before_load(model_cfg, engine_cfg, spec, algorithm) -> None:
        """Refuse a memory budget that cannot hold one full-length request before any weight
        is read (the engine plans again, with the same numbers, after loading)."""
        import jax

        from mtp_jax.engine.memory import plan_memory, planned_weights_bytes

        if engine_cfg.num_pages is not None:
            return
        mtp = algorithm == "mtp"
        stats = jax.devices()[0].memory_stats() or {}
        plan_memory(model_cfg, dtype=engine_cfg.dtype, page_size=engine_cfg.page_size,
                    max_running_requests=engine_cfg.max_running_requests,
                    max_model_len=min(engine_cfg.max_model_len,
                                      model_cfg.max_position_embeddings),
                    k=spec.k, mtp=mtp,
                    weights_bytes=planned_weights_bytes(model_cfg, engine_cfg.dtype,
                                                        mtp and model_cfg.has_mtp, spec),
                    device_bytes=stats.get("bytes_limit"), mem_fraction=engine_cfg.mem_fraction,
                    max_total_tokens=engine_cfg.max_total_tokens)

    def resize_cache(self, *, num_pages: int | None = None,
                     max_running_requests: int | None = None) -> None:
        """Grow or shrink the KV pool (``num_pages``, with the draft KV) and/or the per-slot
        state pool (``max_running_requests``: GDN state, pending tokens, draft distributions)
        between generate calls. See :meth:`Engine.resize_cache`."""
        self.engine.resize_cache(num_pages=num_pages, max_running_requests=max_running_requests)

    # ---- requests ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        """Token ids of one prompt; ``ValueError`` naming what is wrong with it."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint folder has no tokenizer files; pass prompts "
                                 "as lists of token ids (Python: LLM.generate([[1, 2, 3]]); "
                                 "CLI: --prompts-file FILE with lines like "
                                 "{\"prompt\": [1, 2, 3]}).")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist")
                                                   and getattr(prompt, "ndim", 0) == 1):
            prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
            bad = [t for t in prompt
                   if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
            if bad:
                raise ValueError(f"prompt token ids must be ints; got {bad[:5]!r}. Pass a string "
                                 "or a list of token ids.")
            ids, text = [int(t) for t in prompt], None
        else:
            raise ValueError(f"prompt {prompt!r} is neither a string nor a list of token ids.")
        if not ids:
            raise ValueError("empty prompt: a prompt needs at least one token.")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "use ids from this checkpoint's tokenizer.")
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len "
                             f"{self.engine.max_model_len} (it needs room for one output token); "
                             "raise max_model_len (--max-model-len) or shorten the prompt.")
        return text, ids

    def _request(self, prompt, params: SamplingParams) -> Request:
        text, ids = self._prompt_ids(prompt)
        vocab = self.model.cfg.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:  # such an id could never be generated: the stop would never fire
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                             "use ids from this checkpoint's tokenizer.")
        index = self._next_id
        self._next_id += 1
        seed = params.seed if params.seed is not None else (self.seed * 1000003 + index) % 2**32
        return Request(request_id=str(index), index=index, prompt=text, prompt_ids=ids,
                       params=params, seed=seed)

    def _output(self, r: Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids)
            if r.stop_text_len is not None:
                text = text[:r.stop_text_len]
        return RequestOutput(request_id=r.request_id, prompt=r.prompt,
                             prompt_token_ids=r.prompt_ids, token_ids=list(r.output_ids),
                             text=text, finish_reason=r.finish_reason, num_rounds=r.num_rounds,
                             num_draft_tokens=r.num_draft_tokens,
                             num_accepted_tokens=r.num_accepted_tokens,
                             cached_tokens=r.cached_tokens)

    def _prepare(self, prompts, sampling_params):
        """Validate and turn prompts into requests: ``(outputs, [(index, Request)])`` where
        ``outputs`` already holds the error outputs of bad prompts (see :meth:`generate`)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and isinstance(prompts[0], numbers.Integral))
        if single or (hasattr(prompts, "ndim") and prompts.ndim == 1):
            prompts = [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, dict)):
            raise ValueError(f"prompts {prompts!r} ({type(prompts).__name__}) must be a string, "
                             "a list of token ids, or a list of either.")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params is a {type(sampling_params).__name__}; pass a "
                             "SamplingParams (e.g. SamplingParams(**d) for a dict d) or a list "
                             "of one per prompt.")
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts; "
                             "pass one for all or one per prompt.")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] is {type(sp).__name__}, not "
                                 "SamplingParams.")
            sp.validate()
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        requests: list[tuple[int, Request]] = []
        for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
            try:
                requests.append((i, self._request(p, sp)))
            except ValueError as e:
                if len(prompts) == 1:
                    raise
                outputs[i] = self._error_output(p, str(e))
        return outputs, requests

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for ``prompts`` (a string, a token-id list, or a list of either).

        ``sampling_params``: one for all or one per prompt (default ``SamplingParams()``).
        ``use_tqdm``: a progress bar over finished requests.
        Returns one :class:`RequestOutput` per prompt, in order.

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
        tokens (after its prefill and after each round), the last one with ``finished`` set and
        the complete ``output``. Error outputs of bad prompts are yielded first. Closing the
        stream before its end (``stream.close()``) aborts its unfinished requests; errors are
        handled as in :meth:`generate`."""
        outputs, requests = self._prepare(prompts, sampling_params)
        yield from self._stream(outputs, requests, False)

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
        try:
            bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not use_tqdm)
            for i, out in enumerate(outputs):
                if out is not None:
                    yield StreamOutput(index=i, request_id=out.request_id, new_token_ids=[],
                                       finished=True, output=out)
                    self._check_open(call)
            for r in reqs:
                self.engine.add_request(r)
            aborts = self.engine.abort_count
            while True:
                if self.engine.abort_count != aborts:  # some taken out between steps
                    aborts = self.engine.abort_count
                    for i, r in [x for x in live.values() if x[1].finished]:
                        del live[id(r)]  # no step reports them: their last item here
                        bar.update(1)
                        yield StreamOutput(index=i, request_id=r.request_id, new_token_ids=[],
                                           finished=True, output=self._output(r))
                        self._check_open(call)
                    continue  # an abort while those were read is looked for again
                if not self.engine.has_work():
                    break
                for r, new in self.engine.step().items():
                    done = r.finished
                    bar.update(int(done))
                    i = live.pop(id(r))[0] if done else live[id(r)][0]
                    yield StreamOutput(index=i, request_id=r.request_id,
                                       new_token_ids=list(new), finished=done,
                                       output=self._output(r) if done else None)
                    self._check_open(call)
        except BaseException:  # GeneratorExit too: a stream closed early
            self.engine.abort(reqs)
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

    def warmup(self, prompts, sampling_params=None) -> float:
        """Compile, before timing anything, the programs that generating ``prompts`` with
        ``sampling_params`` (as for :meth:`generate`) can call: their prompt-length and batch
        buckets, sampling variant and prefix-cache snapshot variants. Prompts that
        :meth:`generate` would refuse are skipped. Returns the seconds spent (compilation,
        or loading from the persistent cache)."""
        next_id = self._next_id  # warm-up requests must not shift the default seeds
        try:
            _, requests = self._prepare(prompts, sampling_params) if prompts else ([], [])
        except ValueError:
            requests = []  # generate() reports it
        finally:
            self._next_id = next_id
        if not requests:
            return 0.0
        if not hasattr(self.engine, "batch_buckets"):  # qwen4_exp's sequential engine
            import time

            t0 = time.perf_counter()
            self.generate([requests[0][1].prompt_ids], SamplingParams(max_tokens=2, temperature=0))
            self._next_id = next_id
            return time.perf_counter() - t0
        sampled = [r for _, r in requests if r.params.temperature > 0]
        vocab = self.engine.model.cfg.vocab_size
        filters = {self.engine.sampling_rows([r]).filters_any(vocab) for r in sampled}
        return self.engine.warmup(
            sampled=bool(sampled), filtering=filters.pop() if len(filters) == 1 else None,
            max_batch=len(requests),
            max_prompt_len=max(len(r.prompt_ids) for _, r in requests))

    def flush_cache(self) -> None:
        """Empty the prefix cache (entries that running requests use stay)."""
        self.engine.flush_cache()

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters: lookups, hits, prompt tokens, reused tokens."""
        if self.engine.prefix is None:
            return {}
        return dataclasses.asdict(self.engine.prefix.stats)

    def _error_output(self, prompt, message: str) -> RequestOutput:
        index = self._next_id
        self._next_id += 1
        ids = ([int(t) for t in prompt] if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, numbers.Integral) for t in prompt) else [])
        return RequestOutput(request_id=str(index),
                             prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=ids, token_ids=[], text="", finish_reason="error",
                             error=message)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None):
        """Apply the chat template to ``messages`` and generate one reply."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint folder has no tokenizer, so it has no chat template.")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([prompt], sampling_params)[0]
