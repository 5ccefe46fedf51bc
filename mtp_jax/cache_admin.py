"""Cache administration of a live engine: what its pools hold (:func:`cache_status`) and
whether new pool sizes fit the memory budget (:func:`check_resize_fits`), checked before
``Engine.resize_cache`` frees anything, so a refused size leaves the caches as they were.

Used by :meth:`mtp_jax.LLM.cache_status` / :meth:`mtp_jax.LLM.resize_cache` and the server's
``/v1/cache/*`` routes."""

from __future__ import annotations

import dataclasses
import numbers
import os

import jax

from mtp_jax.config import ConfigError

__all__ = ["cache_status", "check_resize_fits", "budget_bytes", "pool_bytes_after"]


def cache_status(engine) -> dict:
    """The engine's pool sizes and use: KV pages (the trash page not counted), slots, queued
    and running requests, and the prefix cache's size and counters. A plain dict (JSON)."""
    book, sched = engine.book, engine.scheduler
    pages = book.pages.size - 1
    status = {
        "num_pages": book.pages.size, "page_size": engine.page_size,
        "kv_pages_total": pages, "kv_pages_free": book.pages.num_free,
        "kv_pages_in_use": pages - book.pages.num_free,
        "max_running_requests": book.max_requests, "free_slots": book.slots.num_free,
        "waiting_requests": len(sched.waiting),
        "running_requests": len(sched.prefilling) + sum(not r.finished for r in sched.decoding),
        "max_model_len": engine.max_model_len,
        "prefix_cache": None,
    }
    if engine.prefix is not None:
        stats = dataclasses.asdict(engine.prefix.stats)
        status["prefix_cache"] = {
            "evictable_pages": engine.prefix.evictable_pages(), **stats,
            "hit_rate": stats["reused_tokens"] / stats["prompt_tokens"]
            if stats["prompt_tokens"] else 0.0}
    return status


def budget_bytes(mem_fraction: float) -> int | None:
    """Bytes the weights and pools may take: ``mem_fraction`` of the device's memory limit, or
    of the host's RAM on the CPU backend (whose device reports no limit); None when neither is
    known."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit and jax.default_backend() == "cpu":
        try:
            limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            limit = None
    return int(limit * mem_fraction) if limit else None


def pool_bytes_after(engine, num_pages: int | None, max_running_requests: int | None) -> int:
    """Bytes of the weights and pools once resized (``None``: that size kept), from the
    engine's memory plan (per-page and per-slot bytes)."""
    plan = engine.plan
    pages = engine.book.pages.size if num_pages is None else num_pages
    slots = engine.book.slots.size if max_running_requests is None else max_running_requests + 1
    return plan.weights_bytes + dataclasses.replace(plan, num_pages=pages,
                                                    slots=slots).pool_bytes


def _check_int(name: str, value, low: int | None) -> None:
    """``value`` (None: not asked) is an int, and ``>= low`` unless ``low`` is None."""
    if value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ConfigError(f"{name} {value!r} must be an int" + (
            f" >= {low}." if low is not None else "."))
    if low is not None and value < low:
        raise ConfigError(f"{name} {value!r} must be an int >= {low}.")


def check_resize_fits(engine, num_pages: int | None = None,
                      max_running_requests: int | None = None) -> None:
    """Raise ``ConfigError`` (nothing changed) when the sizes are not ints, when ``num_pages``
    cannot hold one full-length request, or when the resized pools and the weights would
    exceed the memory budget (:func:`budget_bytes` with the engine's ``mem_fraction``)."""
    _check_int("num_pages", num_pages, None)  # the least that holds a request: below
    _check_int("max_running_requests", max_running_requests, 1)
    if num_pages is not None and num_pages - 1 < engine.max_pages_per_req:
        raise ConfigError(f"num_pages {num_pages} cannot hold one request of max_model_len="
                          f"{engine.max_model_len} ({engine.max_pages_per_req} pages + the "
                          f"trash page); pass at least {engine.max_pages_per_req + 1}.")
    budget = budget_bytes(engine.cfg.mem_fraction)
    need = pool_bytes_after(engine, num_pages, max_running_requests)
    if budget is not None and need > budget:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        asked = ", ".join(f"{k}={v}" for k, v in (("num_pages", num_pages),
                                                  ("max_running_requests", max_running_requests))
                          if v is not None)
        raise ConfigError(
            f"{asked} need "
            f"{gib(need)} for the weights and pools, over the budget of {gib(budget)} "
            f"(mem_fraction={engine.cfg.mem_fraction} of the "
            f"{'host RAM' if jax.default_backend() == 'cpu' else 'device memory'}); the "
            "caches were left as they were. Ask for fewer pages or slots.")
