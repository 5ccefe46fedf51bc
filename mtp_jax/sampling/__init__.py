"""Sampling: request settings (``SamplingParams``, validated once), the batch's device rows
(``SamplingTensors``), the one filtering function (``filtered_probs``) and the random draws.

Layout: :mod:`~mtp_jax.sampling.params` (settings, checks, the one definition of greedy),
:mod:`~mtp_jax.sampling.tensors`, :mod:`~mtp_jax.sampling.filtering` (with the top-k / top-p
kept set of :mod:`~mtp_jax.sampling.keep_set`) and :mod:`~mtp_jax.sampling.draw`. Nothing here
imports the rest of the package.
"""

from mtp_jax.sampling.draw import (SALT_ACCEPT, SALT_DRAFT, SALT_RESIDUAL, SALT_SAMPLE,
                                   categorical, row_keys, sample)
from mtp_jax.sampling.filtering import filtered_logprobs, filtered_probs
from mtp_jax.sampling.params import MAX_LOGPROBS, MAX_TEMPERATURE, SamplingParams, is_greedy
from mtp_jax.sampling.tensors import SamplingTensors

__all__ = ["MAX_LOGPROBS", "MAX_TEMPERATURE", "SALT_ACCEPT", "SALT_DRAFT", "SALT_RESIDUAL",
           "SALT_SAMPLE", "SamplingParams", "SamplingTensors", "categorical", "filtered_logprobs",
           "filtered_probs", "is_greedy", "row_keys", "sample"]
