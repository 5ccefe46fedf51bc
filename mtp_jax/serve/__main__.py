"""``python -m mtp_jax.serve``: see :mod:`mtp_jax.serve.cli`."""

import sys

from mtp_jax.serve.cli import main

sys.exit(main())
