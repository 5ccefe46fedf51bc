"""Everything speculative: acceptance (greedy and exact rejection sampling,
:mod:`~mtp_jax.speculative.accept`), the MTP proposer (draft extend and chained draft steps,
:mod:`~mtp_jax.speculative.mtp`), the per-row draft clamp (:mod:`~mtp_jax.speculative.clamp`),
the reduced draft vocabulary (:mod:`~mtp_jax.speculative.draft_vocab`) and host proposers
(:mod:`~mtp_jax.speculative.external`).

The engine's round program calls these pieces; the models supply the draft layer and heads.
A new proposer is a module here (docs/design.md, "Map of the house").
"""
