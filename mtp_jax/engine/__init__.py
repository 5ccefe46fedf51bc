"""The engine: compiled programs (prefill, speculative round), the step loop and its parts
(pages, prefix cache, device state), executables, warm-up and the memory plan.
:func:`~mtp_jax.engine.serving.make_engine` picks the engine a family's registry entry asks for.
"""
