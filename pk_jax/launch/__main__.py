"""Entry point of `python -m pk_jax.launch` (see pk_jax/launch/__init__.py)."""

import sys

from pk_jax.launch.cli import main

sys.exit(main())
