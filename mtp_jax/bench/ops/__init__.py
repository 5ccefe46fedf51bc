"""Kernel micro-benchmarks, one subcommand of ``python -m mtp_jax.bench`` each: ``attention``,
``gdn``, ``moe``, ``gemv``, ``sampling``, ``draft-head``. Each times an op's variants (the XLA
reference and forms, the Pallas kernels on a GPU) at the real models' shapes with the one
timing helper (:mod:`mtp_jax.bench.timing`) and writes op rows
(:func:`mtp_jax.bench.report.op_row`) through :class:`mtp_jax.bench.subcommand.Results`."""
